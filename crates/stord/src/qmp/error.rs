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

    /// The error of a command whose arguments were read as an option list named `list`
    /// (as `--blockdev` is on the command line): the daemon's texts begin with the list's
    /// name (`blockdev-add: `, an inline child's `blockdev-add (file): `), which QEMU's
    /// QMP texts do not, so it is cut.
    pub fn without_list_name(mut self, list: &str) -> Self {
        if let Some(mut rest) = self.desc.strip_prefix(list) {
            while let Some(role) = rest.strip_prefix(" (") {
                match role.split_once(')') {
                    Some((_, after)) => rest = after,
                    None => return self,
                }
            }
            if let Some(text) = rest.strip_prefix(": ") {
                self.desc = text.to_string();
            }
        }
        self
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

#[cfg(test)]
mod tests {
    use super::QmpError;

    #[test]
    fn a_commands_list_name_is_cut_from_its_texts() {
        let cut = |d: &str| QmpError::generic(d).without_list_name("blockdev-add").desc;
        assert_eq!(
            cut("blockdev-add: Could not open 'x'"),
            "Could not open 'x'"
        );
        assert_eq!(
            cut("blockdev-add (file): Parameter 'filename' is missing"),
            "Parameter 'filename' is missing"
        );
        assert_eq!(cut("blockdev-add (file) (backing): x: y"), "x: y");
        assert_eq!(
            cut("Duplicate nodes with node-name='a'"),
            "Duplicate nodes with node-name='a'"
        );
        assert_eq!(cut("blockdev-add (file"), "blockdev-add (file");
        assert_eq!(cut("blockdev-adder: x"), "blockdev-adder: x");
    }
}
