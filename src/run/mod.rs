//! The run directory `runs/<name>/<run-id>/`: config.toml (the resolved spec), metrics.csv
//! (flushed row by row), train.log, checkpoints/ (see `checkpoint`), model.safetensors (the
//! final weights) and summary.json, written last. A run without a summary.json, or with
//! `"status"` other than `"completed"`, did not finish; an `"interrupted"` one can be
//! resumed. A resume moves what it replaces into superseded/ (`checkpoint::superseded`).

mod metrics;
pub mod summary;

pub use metrics::{MetricsRow, MetricsWriter, METRICS_COLUMNS};
pub use summary::{EndReason, Summary};

use crate::error::{Error, Result};
use crate::spec::JobSpec;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

pub struct RunDir {
    pub path: PathBuf,
    pub id: String,
    /// `.lock` in the directory, locked while this process trains in it (the OS releases it
    /// when the process ends, however it ends): a second process resuming the same run is
    /// refused instead of interleaving its rows and checkpoints with this one's.
    _lock: fs::File,
}

/// The lock file of a run directory.
const LOCK_FILE: &str = ".lock";

/// Where a resumed run's summary.json waits while the resume runs (`set_summary_aside`).
const EARLIER_SUMMARY: &str = ".summary.json.earlier";

/// Takes `dir`'s lock, or says which process holds it. The holder writes its pid into the
/// file, so that a refusal names the process that trains, not an earlier one.
fn lock(dir: &Path) -> Result<fs::File> {
    let path = dir.join(LOCK_FILE);
    let mut file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::Runtime(format!("cannot create {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => {
            // Best effort: the pid only makes a refusal's message more precise.
            let _ = file
                .set_len(0)
                .and_then(|()| file.write_all(std::process::id().to_string().as_bytes()));
            Ok(file)
        }
        Err(fs::TryLockError::WouldBlock) => {
            let pid = lock_holder(dir)
                .or_else(|| fs::read_to_string(&path).ok()?.trim().parse().ok())
                .map_or(String::new(), |pid| format!(" (pid {pid})"));
            Err(Error::Job(format!(
                "run directory {} is being trained by another process{pid}; wait for it to \
                 end, or stop it (Ctrl-C or SIGTERM checkpoints it) and resume then",
                dir.display()
            )))
        }
        Err(fs::TryLockError::Error(e)) => Err(Error::Runtime(format!(
            "cannot lock {}: {e}",
            path.display()
        ))),
    }
}

/// Whether a process on this machine holds `dir`'s lock, and which: the kernel's table of
/// file locks (/proc/locks), read without taking the lock, so that looking (`trainer ls`)
/// never stands in the way of a run starting. None where the table cannot be read or the
/// directory has no lock file (runs of older versions).
///
/// The table names a lock's file by major:minor:inode, with the filesystem's own device,
/// which `stat` does not report on btrfs subvolumes. A line with the lock file's inode
/// whose device differs is confirmed by an open file of the holder's with the lock file's
/// device and inode; where the holder's open files cannot be read (another user's process)
/// the inode is taken as enough: calling a killed run running is the safer mistake (a sweep
/// leaves it alone) than taking over a live one. Holders in another pid namespace are left
/// out of the table by the kernel, so their runs read as not held.
pub(crate) fn lock_state(dir: &Path) -> Option<LockState> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(dir.join(LOCK_FILE)).ok()?;
    let table = lock_table()?;
    let device = format!(
        "{:02x}:{:02x}:{}",
        libc::major(meta.dev()),
        libc::minor(meta.dev()),
        meta.ino()
    );
    let holds = |pid: u32| match fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(fds) => fds.flatten().any(|fd| {
            fs::metadata(fd.path()).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
        }),
        Err(_) => true,
    };
    // "1: FLOCK  ADVISORY  WRITE 4242 00:2a:131077 0 EOF" (a POSIX lock on NFS, which
    // emulates flock so); a process waiting for the lock is listed under it as
    // "1: -> FLOCK ...", and is no holder.
    let holder = table.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let at = fields.iter().position(|f| *f == "FLOCK" || *f == "POSIX")?;
        if at > 0 && fields[at - 1] == "->" {
            return None;
        }
        let (pid, file) = (fields.get(at + 3)?, *fields.get(at + 4)?);
        let pid = pid.parse::<u32>().ok()?;
        let inode = file.rsplit(':').next()?.parse::<u64>().ok()?;
        (file == device || (inode == meta.ino() && holds(pid))).then_some(pid)
    });
    Some(holder.map_or(LockState::Free, LockState::HeldBy))
}

/// /proc/locks, read in reads of 64 KiB. The kernel renders the table afresh at each read's
/// offset, so a lock released between two reads shifts the lines after it, and one can be
/// skipped. `read_to_string` starts with a 32-byte read, so a lock held throughout could read
/// as free; one large read takes a page of lines, about fifty locks, at once.
fn lock_table() -> Option<String> {
    use std::io::Read;
    let mut file = fs::File::open("/proc/locks").ok()?;
    let (mut table, mut chunk) = (Vec::new(), vec![0u8; 1 << 16]);
    loop {
        match file.read(&mut chunk).ok()? {
            0 => return String::from_utf8(table).ok(),
            n => table.extend_from_slice(&chunk[..n]),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockState {
    HeldBy(u32),
    Free,
}

fn lock_holder(dir: &Path) -> Option<u32> {
    match lock_state(dir)? {
        LockState::HeldBy(pid) => Some(pid),
        LockState::Free => None,
    }
}

/// Why a directory could not be made. A path that cannot be one (a file in the way, a name
/// too long, no permission) is the command line's fault, found before anything trained:
/// exit 2. A full disk or an I/O error is a failure while running: exit 1.
pub(crate) fn create_dir_error(what: &str, path: &Path, e: std::io::Error) -> Error {
    use std::io::ErrorKind::*;
    let message = format!("cannot create {what} {}: {e}", path.display());
    match e.kind() {
        // create_dir_all reports a file where a directory should be as AlreadyExists.
        NotADirectory | AlreadyExists => Error::Job(match dangling_link(path) {
            Some((link, target)) => format!(
                "cannot create {what} {}: {} is a symbolic link to {}, which does not exist",
                path.display(),
                link.display(),
                target.display()
            ),
            None => format!(
                "{message}; a file is in the way of the path (--runs-dir, --run-dir, --name)"
            ),
        }),
        // NotFound: a parent that cannot hold directories (/proc).
        InvalidFilename | PermissionDenied | ReadOnlyFilesystem | NotFound => Error::Job(message),
        // Symbolic links that point at each other (ErrorKind::FilesystemLoop is unstable).
        _ if e.raw_os_error() == Some(libc::ELOOP) => Error::Job(message),
        _ => Error::Runtime(message),
    }
}

/// The first of `path` and its parents that is a symbolic link to nothing, and its target.
fn dangling_link(path: &Path) -> Option<(PathBuf, PathBuf)> {
    path.ancestors().find_map(|p| {
        let is_link = fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink());
        // NotFound only: links in a loop are not followed to an end either (ELOOP).
        let to_nothing = fs::metadata(p).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound);
        (is_link && to_nothing)
            .then(|| Some((p.to_path_buf(), fs::read_link(p).ok()?)))
            .flatten()
    })
}

impl RunDir {
    /// Creates a new, unique run directory. The id is the UTC time plus a random suffix, so
    /// ids sort by start time and two runs never share a directory.
    pub fn create(runs_dir: &Path, name: &str) -> Result<RunDir> {
        let parent = runs_dir.join(name);
        fs::create_dir_all(&parent).map_err(|e| create_dir_error("runs directory", &parent, e))?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let stamp = utc_stamp(now.as_secs());
        for attempt in 0u64..100 {
            let suffix = crate::tensor::rng::mix(
                now.as_nanos() as u64 ^ std::process::id() as u64 ^ attempt,
            ) & 0xffff;
            let id = format!("{stamp}-{suffix:04x}");
            let path = parent.join(&id);
            match fs::create_dir(&path) {
                Ok(()) => {
                    let _lock = lock(&path)?;
                    return Ok(RunDir { path, id, _lock });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(create_dir_error("run directory", &path, e)),
            }
        }
        Err(Error::Runtime(format!(
            "cannot find a free run id under {}",
            parent.display()
        )))
    }

    /// An existing run directory, to continue a run in it.
    pub fn open(path: &Path) -> Result<RunDir> {
        if !path.is_dir() {
            return Err(Error::Job(format!(
                "run directory {} does not exist",
                path.display()
            )));
        }
        let id = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(RunDir {
            path: path.to_path_buf(),
            id,
            _lock: lock(path)?,
        })
    }

    /// Creates exactly `path` (a sweep point's directory); its parents may exist already.
    pub fn create_at(path: &Path) -> Result<RunDir> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| create_dir_error("run directory", path, e))?;
        }
        fs::create_dir(path).map_err(|e| match e.kind() {
            // The caller (`--run-dir`, a sweep's point) names a directory to make, not one to use.
            std::io::ErrorKind::AlreadyExists if dangling_link(path).is_none() => {
                Error::Job(format!(
                    "run directory {} already exists; name a new one (or continue that run with \
                 --resume)",
                    path.display()
                ))
            }
            _ => create_dir_error("run directory", path, e),
        })?;
        let id = path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        Ok(RunDir {
            path: path.to_path_buf(),
            id,
            _lock: lock(path)?,
        })
    }

    /// Writes the fully resolved spec, which reproduces the run with `trainer run config.toml`.
    pub fn write_config(&self, spec: &JobSpec, header: &str) -> Result<()> {
        let body = spec
            .recorded()
            .and_then(|table| toml::to_string(&table))
            .map_err(|e| Error::Runtime(format!("cannot serialise the spec: {e}")))?;
        let text = format!("{header}\n{body}");
        self.write_atomic("config.toml", text.as_bytes())
    }

    pub fn write_summary(&self, summary: &Summary) -> Result<()> {
        self.write_atomic(summary::FILE, summary.to_json().as_bytes())?;
        let _ = fs::remove_file(self.path.join(EARLIER_SUMMARY));
        Ok(())
    }

    /// A resumed run's summary.json goes aside until this attempt writes its own (until
    /// then the run must not look finished): renamed, not deleted, so that an attempt that
    /// cannot write a summary at all (a full disk) can put the earlier one back.
    pub fn set_summary_aside(&self) -> Result<()> {
        let summary = self.path.join("summary.json");
        match fs::rename(&summary, self.path.join(EARLIER_SUMMARY)) {
            // No summary: an attempt since the one that wrote any summary set aside did not
            // finish (killed); that summary no longer tells how the run stands.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let _ = fs::remove_file(self.path.join(EARLIER_SUMMARY));
                Ok(())
            }
            Err(e) => Err(Error::Runtime(format!(
                "cannot move {} aside: {e}",
                summary.display()
            ))),
            Ok(()) => Ok(()),
        }
    }

    /// Puts back the summary `set_summary_aside` moved, if there is one; whether it did.
    pub fn restore_summary(&self) -> bool {
        fs::rename(
            self.path.join(EARLIER_SUMMARY),
            self.path.join("summary.json"),
        )
        .is_ok()
    }

    /// Writes a file via a temporary name and a rename, so a reader never sees half of it.
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let tmp = self.path.join(format!(".{name}.tmp"));
        let target = self.path.join(name);
        let io =
            |e: std::io::Error| Error::Runtime(format!("cannot write {}: {e}", target.display()));
        let written = fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()?;
            fs::rename(&tmp, &target)?;
            // The rename itself is on disk only once the directory is (after a power loss
            // the run would otherwise lack the file, or have the older one).
            fs::File::open(&self.path)?.sync_all()
        });
        if written.is_err() {
            let _ = fs::remove_file(&tmp); // a full disk leaves no empty .tmp behind
        }
        written.map_err(io)
    }
}

/// `YYYYMMDD-HHMMSS` in UTC, from seconds since the Unix epoch (civil-from-days algorithm).
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::RunDir;

    #[test]
    fn a_failed_write_leaves_no_temporary_file_and_a_second_process_is_locked_out() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create_at(&tmp.path().join("run")).unwrap();
        // A directory where summary.json goes: the rename fails, as a full disk fails a write.
        std::fs::create_dir_all(run.path.join("summary.json/x")).unwrap();
        assert!(run
            .write_summary(&super::summary::tests::example(false))
            .is_err());
        assert!(!run.path.join(".summary.json.tmp").exists());
        // The lock is per open file: a second opening (as another process's) is refused.
        let e = RunDir::open(&run.path).err().unwrap().to_string();
        let me = std::process::id();
        assert!(
            e.contains(&format!("is being trained by another process (pid {me})")),
            "{e}"
        );
        drop(run);
        assert!(RunDir::open(&tmp.path().join("run")).is_ok());
    }

    /// `ls` and sweeps tell a training run from a killed one by its lock, which ends with
    /// the process however it ends, not by a pid that may have been reused since.
    #[test]
    fn the_lock_table_tells_whether_a_run_is_held_and_by_whom() {
        use super::{lock_state, LockState};
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let run = RunDir::create_at(&dir).unwrap();
        assert_eq!(
            lock_state(&dir),
            Some(LockState::HeldBy(std::process::id()))
        );
        drop(run);
        assert_eq!(lock_state(&dir), Some(LockState::Free));
        assert_eq!(
            lock_state(tmp.path()),
            None,
            "no lock file: an older version's run"
        );
    }

    /// A resume sets the summary aside, and puts it back only when its own attempt can
    /// write none; an attempt that was killed in between leaves nothing to put back.
    #[test]
    fn a_summary_set_aside_comes_back_only_for_the_attempt_that_set_it_aside() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir::create_at(&tmp.path().join("run")).unwrap();
        let summary = run.path.join("summary.json");
        run.write_summary(&super::summary::tests::example(false))
            .unwrap();
        let completed = std::fs::read(&summary).unwrap();
        run.set_summary_aside().unwrap();
        assert!(!summary.exists());
        assert!(run.restore_summary());
        assert_eq!(std::fs::read(&summary).unwrap(), completed);
        // Set aside, then the attempt is killed; the next attempt finds no summary.
        run.set_summary_aside().unwrap();
        run.set_summary_aside().unwrap();
        assert!(!run.restore_summary(), "a stale summary was put back");
        assert!(!summary.exists());
        // A summary written ends any set aside.
        run.write_summary(&super::summary::tests::example(false))
            .unwrap();
        run.set_summary_aside().unwrap();
        run.write_summary(&super::summary::tests::example(true))
            .unwrap();
        assert!(!run.path.join(super::EARLIER_SUMMARY).exists());
    }

    #[test]
    fn stamps_are_utc_calendar_times() {
        assert_eq!(super::utc_stamp(0), "19700101-000000");
        assert_eq!(super::utc_stamp(1_795_392_000 + 3_723), "20261123-010203");
    }
}
