//! The project's error type. Every error carries its exit code class, so `main` can map it
//! without guessing: a bad job or bad usage exits 2, a failure while running exits 1.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug)]
pub enum Error {
    /// The job spec, its data or the command line is wrong: fix the input. Exit code 2.
    Job(String),
    /// Something failed while running a valid job (I/O, numerical blow-up...). Exit code 1.
    Runtime(String),
    /// SIGINT or SIGTERM stopped the run after a checkpoint: exit code 128 + the signal
    /// (130, 143), as a shell reports a death by that signal.
    Interrupted { signal: i32, message: String },
    /// The loss became NaN or infinite: a runtime failure (exit 1) that summaries name.
    Diverged(String),
    /// A data file the job names cannot be read: a bad job (exit 2). The path lets the
    /// caller name the key, and where that key was set.
    UnreadableData { path: PathBuf, message: String },
    /// A job key that does not fit the data or the rest of the model (a layer's shapes, the
    /// loss against the labels): a bad job (exit 2). `message` names the key; `key` lets the
    /// caller say where it was set.
    AtKey { key: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The same error, its message followed by `note` on a line of its own.
    pub fn with_note(self, note: &str) -> Error {
        let add = |m: String| format!("{m}\n{note}");
        match self {
            Error::Job(m) => Error::Job(add(m)),
            Error::Runtime(m) => Error::Runtime(add(m)),
            Error::Diverged(m) => Error::Diverged(add(m)),
            Error::Interrupted { signal, message } => Error::Interrupted {
                signal,
                message: add(message),
            },
            Error::UnreadableData { path, message } => Error::UnreadableData {
                path,
                message: add(message),
            },
            Error::AtKey { key, message } => Error::AtKey {
                key,
                message: add(message),
            },
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Job(_) | Error::UnreadableData { .. } | Error::AtKey { .. } => 2,
            Error::Runtime(_) | Error::Diverged(_) => 1,
            Error::Interrupted { signal, .. } => 128 + signal,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Job(m)
            | Error::Runtime(m)
            | Error::Diverged(m)
            | Error::Interrupted { message: m, .. }
            | Error::UnreadableData { message: m, .. }
            | Error::AtKey { message: m, .. } => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

/// An error with the layer at `key` (`ModelSpec::layer_key`), a `kind` layer:
/// "model.layers[3] (conv2d): `what`".
pub fn layer_error(key: &str, kind: &str, what: impl fmt::Display) -> Error {
    Error::AtKey {
        key: key.to_string(),
        message: format!("{key} ({kind}): {what}"),
    }
}

/// Shorthand for a job error built with `format!`.
#[macro_export]
macro_rules! job_err {
    ($($arg:tt)*) => { $crate::error::Error::Job(format!($($arg)*)) };
}

/// Shorthand for a runtime error built with `format!`.
#[macro_export]
macro_rules! runtime_err {
    ($($arg:tt)*) => { $crate::error::Error::Runtime(format!($($arg)*)) };
}
