//! Setting a FUSE export's mount up: the mountpoint checked, /dev/fuse opened (and cloned,
//! one channel per IoThread), mount(2) with or without `allow_other`, and whether FUSE
//! over io_uring is to be used.

use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use super::options::{AllowOther, FuseOptions};
use super::shared::MAX_READ;
use crate::block::node::block_node::BlockNode;
use crate::sys;

/// The mountpoint's metadata, once it is known to be a regular file that `node` may be
/// exported on as `opts` asks (writable or growable: not a read-only node).
pub(super) fn check_mountpoint(
    what: &str,
    opts: &FuseOptions,
    node: &BlockNode,
) -> Result<Metadata, String> {
    let meta = std::fs::metadata(&opts.mountpoint)
        .map_err(|e| format!("{what}: mountpoint '{}': {e}", opts.mountpoint.display()))?;
    if !meta.file_type().is_file() {
        return Err(format!(
            "{what}: mountpoint '{}' is not a regular file",
            opts.mountpoint.display()
        ));
    }
    if (opts.writable || opts.growable) && node.is_read_only() {
        return Err(format!("{what}: node '{}' is read-only", node.name));
    }
    Ok(meta)
}

/// A new /dev/fuse channel, non-blocking.
pub(super) fn open_dev(what: &str) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open("/dev/fuse")
        .map_err(|e| format!("{what}: cannot open /dev/fuse: {e}"))
}

/// Mounts `dev` at the mountpoint, a file owned by `uid`:`gid`; returns whether
/// `allow_other` is on (`allow-other=auto` tries it first, then goes without).
pub(super) fn mount(
    what: &str,
    opts: &FuseOptions,
    dev: &File,
    uid: u32,
    gid: u32,
) -> Result<bool, String> {
    let try_mount = |allow_other: bool| {
        let mut data = format!(
            "fd={},rootmode={:o},user_id={uid},group_id={gid},max_read={MAX_READ},default_permissions",
            dev.as_raw_fd(),
            libc::S_IFREG
        );
        if allow_other {
            data.push_str(",allow_other");
        }
        let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
        if !opts.writable {
            flags |= libc::MS_RDONLY;
        }
        sys::mount("stord", &opts.mountpoint, "fuse.stord", flags, &data)
    };
    Ok(match opts.allow_other {
        AllowOther::On => {
            try_mount(true).map_err(|e| format!("{what}: mount failed: {e}"))?;
            true
        }
        AllowOther::Off => {
            try_mount(false).map_err(|e| format!("{what}: mount failed: {e}"))?;
            false
        }
        AllowOther::Auto => match try_mount(true) {
            Ok(()) => true,
            Err(_) => {
                try_mount(false).map_err(|e| format!("{what}: mount failed: {e}"))?;
                false
            }
        },
    })
}

/// Whether to ask INIT for FUSE over io_uring: as `io-uring` says, if the kernel offers
/// it. `io-uring=on` on a kernel without it unmounts the (just mounted) export and fails.
pub(super) fn want_uring(what: &str, opts: &FuseOptions) -> Result<bool, String> {
    let kernel_uring = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .map(|v| v.trim() == "Y")
        .unwrap_or(false);
    Ok(match opts.io_uring {
        Some(true) if !kernel_uring => {
            let _ = sys::umount(&opts.mountpoint, libc::MNT_DETACH);
            return Err(format!(
                "{what}: io-uring=on but the kernel does not offer FUSE over io_uring \
                 (/sys/module/fuse/parameters/enable_uring is not Y)"
            ));
        }
        Some(b) => b,
        None => {
            if !kernel_uring {
                tracing::info!(
                    "fuse: FUSE over io_uring is not enabled in the kernel; using /dev/fuse"
                );
            }
            kernel_uring
        }
    })
}

/// The channels of `n` queues: `first`, and clones of it (FUSE_DEV_IOC_CLONE) for the
/// others.
pub(super) fn channels(what: &str, first: Arc<File>, n: usize) -> Result<Vec<Arc<File>>, String> {
    let mut devs = vec![first.clone()];
    for _ in 1..n {
        let clone = open_dev(what)?;
        sys::fuse_clone(clone.as_raw_fd(), first.as_raw_fd())
            .map_err(|e| format!("{what}: FUSE_DEV_IOC_CLONE failed: {e}"))?;
        devs.push(Arc::new(clone));
    }
    Ok(devs)
}
