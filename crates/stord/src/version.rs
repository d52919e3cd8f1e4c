//! The versions stord reports, in one place: the QEMU release whose interface (command line
//! and QMP) it implements, and its own.
//!
//! Management tools read the QMP greeting's or `query-version`'s `qemu` triple and gate
//! features on it, so that triple is the interface stord offers, not stord's own number;
//! stord names itself in `package`, where a QEMU build names its distribution's package.
//! `stord --version` prints the same two in qemu-storage-daemon's shape.

use serde_json::{json, Value};

/// A QEMU version: QAPI's `VersionTriple`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
}

/// The newest qemu-storage-daemon release whose whole command line and QMP stord
/// implements (and its tests compare with). Additions of later releases that stord has
/// (10.1's qom-list-get and keep-alive options, 11.1's monitor-qmp objects, ...) are in
/// `query-qmp-schema`, where tools probe for them; they do not move this number, which
/// would promise the rest of that release. When the rest arrives, this line changes.
pub const QEMU_INTERFACE: QemuVersion = QemuVersion {
    major: 10,
    minor: 0,
    micro: 2,
};

/// stord's own name and version: QMP's `package`.
pub const PACKAGE: &str = concat!("stord ", env!("CARGO_PKG_VERSION"));

/// The last line of `--version`, where QEMU names its copyright holders.
const COPYRIGHT: &str = "Copyright (c) 2026 the stord developers";

/// QAPI's `VersionInfo`, as `query-version` returns it and the greeting carries it.
pub fn version_info() -> Value {
    let QemuVersion {
        major,
        minor,
        micro,
    } = QEMU_INTERFACE;
    json!({
        "qemu": { "major": major, "minor": minor, "micro": micro },
        "package": PACKAGE,
    })
}

/// What `stord --version` prints, in qemu-storage-daemon's shape (`NAME version QEMU
/// (PACKAGE)`, then the copyright line): the interface version where qsd prints its QEMU
/// version, stord's own name and version where qsd names its package.
pub fn version_text() -> String {
    let QemuVersion {
        major,
        minor,
        micro,
    } = QEMU_INTERFACE;
    format!("stord version {major}.{minor}.{micro} ({PACKAGE})\n{COPYRIGHT}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// qemu-storage-daemon's shapes (`query-version`'s members, `--version`'s two lines)
    /// with stord in place of the distribution's package; the triple itself is compared
    /// with qsd's by tests/qmp/monitor_modes.py.
    #[test]
    fn qsds_shapes_with_stords_name() {
        let QemuVersion {
            major,
            minor,
            micro,
        } = QEMU_INTERFACE;
        let info = version_info();
        assert_eq!(
            info["qemu"],
            json!({ "major": major, "minor": minor, "micro": micro })
        );
        let ours = format!("stord {}", env!("CARGO_PKG_VERSION"));
        assert_eq!(info["package"], ours.as_str());
        let text = version_text();
        let first = text.lines().next().unwrap();
        assert_eq!(
            first,
            format!("stord version {major}.{minor}.{micro} ({ours})")
        );
        assert!(text.lines().nth(1).unwrap().starts_with("Copyright (c) "));
        assert_eq!(text.lines().count(), 2);
    }
}
