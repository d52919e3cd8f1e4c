//! Guest memory that vanishes under the daemon.
//!
//! A vhost-user frontend shares its memory as files the daemon maps. If it truncates such a
//! file afterwards, the next access to the lost pages raises SIGBUS, which by default kills
//! the whole daemon and every export with it. Regions are therefore registered here
//! ([`watch`]): a SIGBUS whose address lies in a registered region replaces that whole
//! region with private zero pages (the faulting access then completes on them) and raises
//! the region's flag, so the device can fail that one connection. A SIGBUS anywhere else
//! restores the default action and faults again, as before. [`GuestFault`] is that flag as
//! a device's queues see it, and [`within_file`] refuses up front a mapping that would
//! fault from its first access.
//!
//! The handler only reads a fixed table of atomics and calls mmap(2) (a plain system call
//! on Linux), so it is async-signal-safe. The kernel's own accesses to such memory (O_DIRECT
//! I/O straight into guest buffers) fail with EFAULT instead and never get here.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Regions that can be watched at once (each vhost-user connection maps at most 509).
const SLOTS: usize = 4096;

struct Slot {
    /// 0: free.
    start: AtomicUsize,
    len: AtomicUsize,
    /// The flag to raise (owned by the [`Watch`], which outlives the registration).
    flag: AtomicPtr<AtomicBool>,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    flag: AtomicPtr::new(std::ptr::null_mut()),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
static INSTALL: Once = Once::new();

/// A registered region; unregistered when dropped (drop it only while the region is still
/// mapped, or after it is unmapped: never let the mapping outlive it).
pub struct Watch {
    slot: usize,
    _flag: Arc<AtomicBool>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        s.flag.store(std::ptr::null_mut(), Ordering::SeqCst);
        s.len.store(0, Ordering::SeqCst);
        s.start.store(0, Ordering::SeqCst);
    }
}

/// Watches the mapping [`start`, `start + len`): a SIGBUS in it raises `flag` instead of
/// killing the process. None if the table is full (the region is then unprotected).
pub fn watch(start: usize, len: usize, flag: &Arc<AtomicBool>) -> Option<Watch> {
    INSTALL.call_once(install);
    for (i, s) in TABLE.iter().enumerate() {
        if s.start
            .compare_exchange(0, usize::MAX, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            s.flag
                .store(Arc::as_ptr(flag) as *mut AtomicBool, Ordering::SeqCst);
            s.len.store(len, Ordering::SeqCst);
            s.start.store(start, Ordering::SeqCst);
            return Some(Watch {
                slot: i,
                _flag: flag.clone(),
            });
        }
    }
    None
}

fn install() {
    // SAFETY: a zeroed sigaction is a valid value to fill in; sa_sigaction is set to a
    // handler with the three-argument signature SA_SIGINFO requires.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
            tracing::warn!(
                "cannot handle SIGBUS: a frontend that shrinks its memory will stop the daemon"
            );
        }
    }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers; si_addr is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in TABLE.iter() {
        let start = s.start.load(Ordering::SeqCst);
        let len = s.len.load(Ordering::SeqCst);
        if start == 0 || start == usize::MAX || addr < start || addr - start >= len {
            continue;
        }
        // SAFETY: [start, start + len) is a mapping of ours (registered while mapped);
        // replacing it with private anonymous pages of the same size at the same address
        // leaves every pointer into it valid. mmap is a raw system call here.
        let r = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if r == libc::MAP_FAILED {
            break;
        }
        let flag = s.flag.load(Ordering::SeqCst);
        if !flag.is_null() {
            // SAFETY: the Watch holding this slot keeps the flag's Arc alive while the
            // pointer is stored.
            unsafe { (*flag).store(true, Ordering::SeqCst) };
        }
        return;
    }
    // Not guest memory: the default action, on the fault that follows.
    // SAFETY: signal(2) with SIG_DFL is async-signal-safe.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

/// A connection's guest memory vanished (the frontend truncated a file it shared; see
/// [`watch`]): its queues stop and its connection is closed, once.
pub struct GuestFault {
    /// Raised by the SIGBUS handler.
    pub flag: Arc<std::sync::atomic::AtomicBool>,
    /// The connection, to close (none for a device with no connection: VDUSE).
    sock: Option<std::os::unix::net::UnixStream>,
    reported: std::sync::atomic::AtomicBool,
}

impl GuestFault {
    pub fn new(sock: std::os::unix::net::UnixStream) -> Self {
        Self {
            flag: Arc::default(),
            sock: Some(sock),
            reported: Default::default(),
        }
    }

    /// For memory mapped from a kernel device (VDUSE), raised through `flag`: the queues
    /// stop, and there is no connection to close.
    pub fn with_flag(flag: Arc<AtomicBool>) -> Self {
        Self {
            flag,
            sock: None,
            reported: Default::default(),
        }
    }

    /// Whether the memory vanished; the first time, logs it and closes the connection.
    pub fn check(&self, dev: &str) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.flag.load(SeqCst) {
            return false;
        }
        if !self.reported.swap(true, SeqCst) {
            if self.sock.is_some() {
                tracing::warn!(
                    "vhost-user-blk {dev}: the frontend's memory vanished under the device \
                     (its file was truncated); closing that connection"
                );
            } else {
                tracing::warn!(
                    "vduse-blk {dev}: a driver buffer was not backed by memory (SIGBUS); the \
                     queues stop until the driver resets the device"
                );
            }
            if let Some(sock) = &self.sock {
                let _ = sock.shutdown(std::net::Shutdown::Both);
            }
        }
        true
    }
}

/// Checks that `len` bytes at `offset` of a frontend's file exist. A mapping past the end
/// of its file maps pages that fault with SIGBUS when touched (vm-memory does not check),
/// so a region larger than the frontend's file would kill the daemon at the first access
/// (found by the vhost_user_messages fuzz target). Shared memory comes as regular files
/// (memfd, hugetlbfs, /dev/shm), which have a size to check against. (A frontend that
/// shrinks its file afterwards can still fault us, as it can QEMU's vhost-user servers.)
pub fn within_file(f: &std::fs::File, offset: u64, len: u64) -> Result<(), String> {
    let meta = f
        .metadata()
        .map_err(|e| format!("memory region's file: {e}"))?;
    if meta.is_file() && offset.checked_add(len).is_none_or(|end| end > meta.len()) {
        return Err(format!(
            "memory region of {len} bytes at offset {offset} runs past its file's {} bytes",
            meta.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A shared file mapping whose file is truncated: the access that would raise SIGBUS
    /// completes on zero pages and the flag is up.
    #[test]
    fn a_truncated_mapping_reads_zero_and_raises_the_flag() {
        let f = crate::sys::memfd_create("guest").unwrap();
        f.set_len(1 << 20).unwrap();
        // SAFETY: a fresh shared mapping of the memfd, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 20,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let flag = Arc::new(AtomicBool::new(false));
        let w = watch(p as usize, 1 << 20, &flag).unwrap();
        // SAFETY: within the mapping.
        unsafe { std::ptr::write_volatile((p as *mut u8).add(4096), 7) };
        f.set_len(0).unwrap();
        // SAFETY: within the mapping; the page is gone, so this faults and is repaired.
        let v = unsafe { std::ptr::read_volatile((p as *const u8).add(8192)) };
        assert_eq!(v, 0);
        assert!(flag.load(Ordering::SeqCst));
        drop(w);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 1 << 20) };
    }
}
