//! The file driver's limits, as QEMU's file-posix raw_refresh_limits finds them: O_DIRECT's
//! alignment for requests and buffers (1 without O_DIRECT), buffers of at least a page;
//! for a block device, the kernel's largest request and most segments, and its discard
//! granularity (`/sys/dev/block/MAJOR:MINOR/queue/...`).

use std::os::fd::RawFd;
use std::os::unix::fs::MetadataExt;

use crate::block::node::limits::BlockLimits;

/// QEMU's BDRV_REQUEST_MAX_BYTES: INT_MAX rounded down to a sector.
const REQUEST_MAX_BYTES: u64 = (i32::MAX as u64) & !511;

/// A number in the device's `queue/NAME` in sysfs (QEMU's get_sysfs_u32_val).
fn queue_value(filename: &str, name: &str) -> Option<u64> {
    let rdev = std::fs::metadata(filename).ok()?.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let path = format!("/sys/dev/block/{major}:{minor}/queue/{name}");
    std::fs::read_to_string(path).ok()?.trim_end().parse().ok()
}

/// Puts the file's limits in `bl` (`align` is the O_DIRECT alignment, 1 without it).
pub(super) fn refresh(
    bl: &mut BlockLimits,
    fd: RawFd,
    align: u64,
    block_device: bool,
    filename: &str,
) {
    bl.request_alignment = align as u32;
    bl.min_mem_alignment = align;
    bl.opt_mem_alignment = align.max(crate::sys::page_size());
    if !block_device {
        return;
    }
    if let Some(max) = crate::sys::block_max_transfer(fd).filter(|&m| m <= REQUEST_MAX_BYTES) {
        bl.max_hw_transfer = max as u32;
    }
    if let Some(segments) = queue_value(filename, "max_segments").filter(|&s| s > 0) {
        bl.max_hw_iov = segments as i64;
    }
    if let Some(granularity) = queue_value(filename, "discard_granularity") {
        let ralign = u64::from(bl.request_alignment);
        let dalign = if granularity != 0 && granularity < ralign && ralign % granularity == 0 {
            ralign
        } else {
            granularity
        };
        if dalign % ralign == 0 {
            bl.discard_alignment = dalign as u32;
        }
    }
}
