//! SIGINT and SIGTERM during a run: the first asks the training loop to stop after the
//! current optimizer step and write a checkpoint (exit 130 or 143, as a shell reports a
//! death by that signal); a second one ends the process at once. Stopping at once corrupts
//! nothing: checkpoints are replaced by rename only when complete, and metrics.csv rows
//! after the last checkpoint are dropped when the run is resumed. A launcher, which trains
//! nothing, only notes them to pass them on (`Received`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub use signal_hook::consts::{SIGINT, SIGTERM};

/// Whether SIGINT or SIGTERM asked this process to stop, and which.
pub struct Stop {
    requested: Arc<AtomicBool>,
    signal: Arc<AtomicUsize>,
}

/// What a second signal says as it ends the process at once (from the signal handler: a
/// fixed text, written as it is; it may come before anything trained).
const SECOND_SIGINT: &[u8] = b"\nerror: a second SIGINT: stopped at once; what came after the \
newest checkpoint, if the run wrote one, is lost (resume from that checkpoint)\n";
const SECOND_SIGTERM: &[u8] = b"\nerror: a second SIGTERM: stopped at once; what came after the \
newest checkpoint, if the run wrote one, is lost (resume from that checkpoint)\n";

/// The process's stop flags, once `Stop::install` registered them.
static FLAGS: Mutex<Option<(Arc<AtomicBool>, Arc<AtomicUsize>)>> = Mutex::new(None);

impl Stop {
    /// Registers the handlers the first time; later calls share them. They stay for the
    /// rest of the process: a signal handler once installed stays installed, so removing
    /// its actions would leave a signal that comes between two runs (a sweep's points, or
    /// the next one loading its data) caught and forgotten. Kept, it stops the next check.
    pub fn install() -> std::io::Result<Stop> {
        let mut flags = FLAGS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if flags.is_none() {
            let requested = Arc::new(AtomicBool::new(false));
            let signal = Arc::new(AtomicUsize::new(0));
            for sig in [SIGINT, SIGTERM] {
                // Order matters: the exit is armed by the flag that the first signal sets,
                // so it must be registered before the action that sets it.
                let armed = Arc::clone(&requested);
                let said: &'static [u8] = match sig {
                    SIGINT => SECOND_SIGINT,
                    _ => SECOND_SIGTERM,
                };
                // SAFETY: the action only loads an atomic, writes to stderr and _exits, all
                // async-signal-safe.
                unsafe {
                    signal_hook::low_level::register(sig, move || {
                        if armed.load(Ordering::SeqCst) {
                            libc::write(2, said.as_ptr().cast(), said.len());
                            libc::_exit(128 + sig);
                        }
                    })?;
                }
                signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize)?;
                signal_hook::flag::register(sig, Arc::clone(&requested))?;
            }
            *flags = Some((requested, signal));
        }
        let (requested, signal) = flags.clone().expect("registered above");
        Ok(Stop { requested, signal })
    }

    /// The signal that asked to stop, if one did.
    pub fn requested(&self) -> Option<i32> {
        if self.requested.load(Ordering::SeqCst) {
            Some(self.signal.load(Ordering::SeqCst) as i32)
        } else {
            None
        }
    }
}

/// "SIGINT" or "SIGTERM".
pub fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        _ => "SIGTERM",
    }
}

/// SIGINT and SIGTERM as they arrive, for a process that passes them on to its children
/// (a launcher): unlike `Stop`, a second one does not end this process; the child decides.
pub struct Received {
    flags: [(i32, Arc<AtomicBool>); 2],
    ids: Vec<signal_hook::SigId>,
}

impl Received {
    pub fn install() -> std::io::Result<Received> {
        let flags = [SIGINT, SIGTERM].map(|s| (s, Arc::new(AtomicBool::new(false))));
        let mut ids = Vec::new();
        for (signal, flag) in &flags {
            ids.push(signal_hook::flag::register(*signal, Arc::clone(flag))?);
        }
        Ok(Received { flags, ids })
    }

    /// The signals received since the last call.
    pub fn take(&self) -> Vec<i32> {
        self.flags
            .iter()
            .filter(|(_, flag)| flag.swap(false, Ordering::SeqCst))
            .map(|(signal, _)| *signal)
            .collect()
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// A write beyond the file-size limit (`ulimit -f`) raises SIGXFSZ, whose default action
/// ends the process without a word, leaving a run marked "running". Ignored, the write fails
/// with EFBIG instead, and the run fails as for a full disk: the file named, the run's
/// summary written when it can be, the resume command given.
pub fn report_file_size_limit_as_error() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}
