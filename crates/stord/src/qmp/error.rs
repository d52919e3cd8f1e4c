//! A QMP error reply's contents (the class QEMU names and its text), and how the daemon's
//! and the command line's errors become one. Every command handler returns it; the
//! monitor writes it out.

/// An error reply.
#[derive(Debug, Clone)]
pub struct QmpError {
    /// QAPI error class (GenericError, CommandNotFound, ...).
    pub class: &'static str,
    /// Human-readable description.
    pub desc: String,
}

impl QmpError {
    /// A GenericError.
    pub fn generic(desc: impl Into<String>) -> Self {
        Self {
            class: "GenericError",
            desc: desc.into(),
        }
    }
}

impl From<crate::daemon::DaemonError> for QmpError {
    /// The error's message; a hint on the lines after it (a lock's "Is another process
    /// using the image") is for the command line only, as QEMU's error_append_hint.
    fn from(e: crate::daemon::DaemonError) -> Self {
        let text = e.to_string();
        let desc = match text.split_once('\n') {
            Some((first, _)) => first.to_string(),
            None => text,
        };
        Self {
            class: e.qmp_class(),
            desc,
        }
    }
}

impl From<crate::cli::keyval::OptionError> for QmpError {
    fn from(e: crate::cli::keyval::OptionError) -> Self {
        QmpError::generic(e.to_string())
    }
}

impl From<String> for QmpError {
    fn from(s: String) -> Self {
        QmpError::generic(s)
    }
}
