//! provenance.json in each run directory, written when the run starts: enough to trace a
//! number or a figure back to the binary, the machine, the command and the exact spec.

use crate::error::Result;
use crate::run::RunDir;
use crate::runtime_err;
use crate::spec::JobSpec;
use crate::train::parallel::BatchLayout;

/// FNV-1a, 64 bits: small, stable across Rust versions and platforms (unlike `Hash`).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A hash of the resolved spec as config.toml records it (every default filled in), so two
/// runs with the same hash trained the same job, however it was spelled (file, environment,
/// --set, a default written out or left implied).
pub fn spec_hash(spec: &JobSpec) -> Result<String> {
    // As JSON, whose maps sort their keys: a default filled in comes last in its table,
    // where the same value given explicitly has its own place.
    let body = spec
        .recorded()
        .map_err(|e| runtime_err!("cannot serialise the spec: {e}"))
        .and_then(|table| {
            serde_json::to_value(&table)
                .map(|sorted| sorted.to_string())
                .map_err(|e| runtime_err!("cannot serialise the spec: {e}"))
        })?;
    Ok(format!("fnv1a64:{:016x}", fnv1a64(body.as_bytes())))
}

/// The command line as a shell would need it typed.
pub fn command_line() -> String {
    std::env::args_os()
        .map(|a| shell_quote_os(&a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `arg` as a shell reads it back: plain, or single-quoted.
pub(crate) fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// `arg` as a shell reads it back, also when it is not UTF-8 (a path can be any bytes):
/// then in bash's `$'...'` quoting, each byte that is not printable ASCII as `\xHH`.
pub(crate) fn shell_quote_os(arg: &std::ffi::OsStr) -> String {
    use std::os::unix::ffi::OsStrExt;
    if let Some(text) = arg.to_str() {
        return shell_quote(text);
    }
    let mut quoted = String::from("$'");
    for &b in arg.as_bytes() {
        match b {
            b'\\' | b'\'' => quoted += &format!("\\{}", b as char),
            0x20..=0x7e => quoted.push(b as char),
            _ => quoted += &format!("\\x{b:02x}"),
        }
    }
    quoted + "'"
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The CPU's model name, from /proc/cpuinfo.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Writes provenance.json. The host and process id also let `trainer ls` tell a run that
/// is still going from one that was killed. `batch` records how the batch was divided (the
/// global batch is not a metrics.csv column: its columns are fixed for readers and resumes).
pub fn write(run: &RunDir, spec: &JobSpec, device: &str) -> Result<()> {
    let layout = BatchLayout::of(spec);
    let value = serde_json::json!({
        "trainer_version": env!("CARGO_PKG_VERSION"),
        "git_commit": env!("TRAINER_GIT_COMMIT"),
        "command_line": command_line(),
        "working_dir": std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
        "device": device,
        "batch": {
            "per_replica": layout.per_replica(),
            "replicas": layout.replicas,
            "grad_accum_steps": layout.accumulation,
            "global": layout.global(),
        },
        "cpu": cpu_model(),
        "host": hostname(),
        "pid": std::process::id(),
        "spec_hash": spec_hash(spec)?,
    });
    let text = serde_json::to_string_pretty(&value).unwrap_or_default() + "\n";
    run.write_atomic("provenance.json", text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn arguments_are_quoted_only_when_needed() {
        assert_eq!(shell_quote("optimizer.lr=3e-4"), "optimizer.lr=3e-4");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    /// A path that is not UTF-8 is written so that bash reads back its bytes.
    #[test]
    fn bytes_that_are_not_utf8_are_quoted_as_bash_escapes() {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::OsStr::from_bytes(b"runs/r\xff\xfe/it's a\\b");
        let quoted = shell_quote_os(path);
        assert_eq!(quoted, r"$'runs/r\xff\xfe/it\'s a\\b'");
        let echoed = std::process::Command::new("bash")
            .args(["-c", &format!("printf %s {quoted}")])
            .output()
            .unwrap();
        assert_eq!(echoed.stdout, path.as_bytes());
        assert_eq!(shell_quote_os("a b".as_ref()), "'a b'");
    }
}
