//! QEMU's image locking, so QEMU's tools, qsd and stord see each other's use of an image.
//!
//! The file's permissions ([`Perm`]) become shared OFD locks on single bytes of the image
//! file, at the offsets QEMU's file-posix driver uses: byte 100 + i while this file node
//! holds permission bit i, byte 200 + i while it does not let others hold bit i. Another
//! opener that wants bit i looks for a lock on byte 200 + i; one that does not share bit i
//! looks for a lock on byte 100 + i. OFD locks belong to the open file description, so
//! two nodes opening one file see each other, in one process or two, and they go away
//! with the descriptor (a killed daemon leaves no stale lock).

use std::os::fd::RawFd;
use std::sync::Mutex;

use crate::block::node::perm::{Perm, PermError};
use crate::sys;

/// First byte of the "holds permission i" locks.
const PERM_BASE: u64 = 100;
/// First byte of the "does not share permission i" locks.
const SHARED_BASE: u64 = 200;

fn bit_index(p: Perm) -> u64 {
    p.bits().trailing_zeros() as u64
}

/// The locks one file node holds.
#[derive(Debug)]
pub(crate) struct ImageLock {
    /// `locking=off` turns it off.
    enabled: bool,
    /// The file's name, for the hint in errors.
    filename: String,
    /// (permissions held, permissions not shared) as locked now.
    held: Mutex<(Perm, Perm)>,
}

impl ImageLock {
    pub(crate) fn new(enabled: bool, filename: &str) -> Self {
        Self {
            enabled,
            filename: filename.to_string(),
            held: Mutex::new((Perm::NONE, Perm::NONE)),
        }
    }

    /// The descriptor's open file was replaced: it holds no locks any more, so the next
    /// [`set`](Self::set) takes them all again.
    pub(crate) fn forget(&self) {
        *self.held.lock().expect("image lock") = (Perm::NONE, Perm::NONE);
    }

    /// Locks exactly the bytes for `perm` held and `unshared` not shared.
    fn lock_bytes(fd: RawFd, perm: Perm, unshared: Perm) -> Result<(), u64> {
        for (p, _) in Perm::ALL.each() {
            let i = bit_index(p);
            sys::ofd_lock_byte(fd, PERM_BASE + i, perm.contains(p)).map_err(|_| PERM_BASE + i)?;
            sys::ofd_lock_byte(fd, SHARED_BASE + i, unshared.contains(p))
                .map_err(|_| SHARED_BASE + i)?;
        }
        Ok(())
    }

    /// The first conflict with another opener's locks, in QEMU's words.
    fn check(&self, fd: RawFd, perm: Perm, unshared: Perm) -> Result<(), PermError> {
        let locked = |off| sys::ofd_byte_locked_elsewhere(fd, off).unwrap_or(true);
        let hint = |what: String| {
            PermError::Locked(format!(
                "{what}\nIs another process using the image [{}]?",
                self.filename
            ))
        };
        for (p, name) in perm.each() {
            if locked(SHARED_BASE + bit_index(p)) {
                return Err(hint(format!("Failed to get \"{name}\" lock")));
            }
        }
        for (p, name) in unshared.each() {
            if locked(PERM_BASE + bit_index(p)) {
                return Err(hint(format!("Failed to get shared \"{name}\" lock")));
            }
        }
        Ok(())
    }

    /// Moves the locks to `perm` taken and `shared` shared, as QEMU does: first lock the
    /// union of old and new (so nobody slips in between), check that no other opener is
    /// in the way, then drop what is no longer needed; on a conflict, back to the old
    /// locks.
    pub(crate) fn set(&self, fd: RawFd, perm: Perm, shared: Perm) -> Result<(), PermError> {
        if !self.enabled {
            return Ok(());
        }
        let mut held = self.held.lock().expect("image lock");
        let (old_perm, old_unshared) = *held;
        let unshared = shared.complement();
        let loosening = old_perm.contains(perm) && old_unshared.contains(unshared);
        if !loosening {
            if let Err(byte) = Self::lock_bytes(fd, old_perm | perm, old_unshared | unshared) {
                let _ = Self::lock_bytes(fd, old_perm, old_unshared);
                return Err(PermError::Locked(format!("Failed to lock byte {byte}")));
            }
            if let Err(e) = self.check(fd, perm, unshared) {
                let _ = Self::lock_bytes(fd, old_perm, old_unshared);
                return Err(e);
            }
        }
        if let Err(byte) = Self::lock_bytes(fd, perm, unshared) {
            tracing::warn!("{}: cannot update the lock on byte {byte}", self.filename);
        }
        *held = (perm, unshared);
        Ok(())
    }
}
