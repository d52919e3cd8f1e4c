//! Options every node takes, whatever its driver (QEMU's generic block options).

/// `detect-zeroes`: what a node does with writes whose data is all zeroes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Writes them as they are.
    #[default]
    Off,
    /// Turns them into write-zeroes requests.
    On,
    /// Into write-zeroes that may leave holes (needs `discard=unmap` on the node).
    Unmap,
}

impl DetectZeroes {
    /// As QMP names it.
    pub fn name(self) -> &'static str {
        match self {
            DetectZeroes::Off => "off",
            DetectZeroes::On => "on",
            DetectZeroes::Unmap => "unmap",
        }
    }
}

/// Options every node takes, whatever its driver (QEMU's generic block options).
#[derive(Debug, Clone, Copy, Default)]
pub struct CommonOptions {
    /// `detect-zeroes`.
    pub detect_zeroes: DetectZeroes,
    /// `discard=unmap|on`: discards reach the driver (QEMU's default, `ignore`, drops
    /// them at the node).
    pub unmap: bool,
    /// `force-share=on`.
    pub force_share: bool,
}
