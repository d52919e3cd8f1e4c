//! One virtio-blk request: a descriptor chain ([`Chain`]) whose device-readable part starts with a
//! 16-byte header (type, ioprio, sector) and whose device-writable part ends with the status
//! byte. Reads and writes hand the node the guest's own pages as an [`IoVec`] (lent from
//! the guest memory mapping, which the request keeps alive), so the file backend reads into
//! and writes from them directly; a buffer is used only when a piece crosses a memory
//! region (and, under O_DIRECT, by the file backend when the pieces are not aligned).

use std::io;
use std::sync::Arc;

use virtio_bindings::virtio_blk::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::chain::{Chain, Segment};
use super::device::{BlkDevice, MAX_DISCARD_SECTORS, MAX_REQUEST_BYTES};
use crate::block::node::block_node::BlockNode;
use crate::buf::request_buf;
use crate::iov::IoVec;

/// Copies `dst.len()` bytes starting `skip` bytes into `segs` out of guest memory.
fn gather(mem: &GuestMemoryMmap, segs: &[Segment], mut skip: u64, dst: &mut [u8]) -> bool {
    let mut done = 0;
    for s in segs {
        if done == dst.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(dst.len() - done);
        let Some(at) = s.addr.checked_add(skip) else {
            return false;
        };
        if mem
            .read_slice(&mut dst[done..done + n], GuestAddress(at))
            .is_err()
        {
            return false;
        }
        done += n;
        skip = 0;
    }
    done == dst.len()
}

/// Copies `src` into guest memory across `segs` (from their start; whatever of `segs` is
/// left over, such as the status byte, is not touched).
fn scatter(mem: &GuestMemoryMmap, segs: &[Segment], src: &[u8]) -> bool {
    let mut done = 0;
    for s in segs {
        if done == src.len() {
            break;
        }
        let n = (s.len as usize).min(src.len() - done);
        if mem
            .write_slice(&src[done..done + n], GuestAddress(s.addr))
            .is_err()
        {
            return false;
        }
        done += n;
    }
    done == src.len()
}

/// `len` bytes of guest memory named by `segs`, from byte `skip` of them, lent to the block
/// layer as an [`IoVec`] that keeps `mem` mapped. None if a piece lies outside guest
/// memory or across two regions (the caller copies through a buffer then).
fn guest_iov(
    mem: &Arc<GuestMemoryMmap>,
    segs: &[Segment],
    mut skip: u64,
    len: u64,
) -> Option<IoVec> {
    const INLINE: usize = 8;
    let mut inline = [(std::ptr::null_mut::<u8>(), 0usize); INLINE];
    let mut spilled = Vec::new();
    let mut n = 0;
    let mut left = len;
    for s in segs {
        if left == 0 {
            break;
        }
        let seg = u64::from(s.len);
        if skip >= seg {
            skip -= seg;
            continue;
        }
        let take = (seg - skip).min(left);
        let slice = mem
            .get_slice(GuestAddress(s.addr.checked_add(skip)?), take as usize)
            .ok()?;
        let piece = (slice.ptr_guard_mut().as_ptr(), take as usize);
        if n < INLINE {
            inline[n] = piece;
        } else {
            if spilled.is_empty() {
                spilled.extend_from_slice(&inline);
            }
            spilled.push(piece);
        }
        n += 1;
        skip = 0;
        left -= take;
    }
    if left != 0 {
        return None;
    }
    let pieces = if n <= INLINE {
        &inline[..n]
    } else {
        &spilled[..]
    };
    // SAFETY: each piece is a slice of one region of `mem` (get_slice checked its bounds),
    // mapped read-write and shared with the guest for as long as the Arc we hand over keeps
    // the mapping; we create no references to it.
    Some(unsafe { IoVec::lent(pieces, mem.clone()) })
}

/// Runs one request and returns the number of bytes written to the device-writable part
/// (the used length). Failures are reported in the status byte; a chain too broken to carry
/// a status is logged and completed with length 0.
pub async fn execute(dev: &BlkDevice, mem: &Arc<GuestMemoryMmap>, chain: &Chain) -> u32 {
    let in_len = chain.in_len();
    let Some(last) = chain.inn.last().copied().filter(|s| s.len > 0) else {
        tracing::warn!("{} {}: request without a status byte", dev.kind, dev.id);
        return 0;
    };
    // The last byte of the last segment; a segment that wraps past the top of the address
    // space has no last byte we could write (found by the virtio_blk_chain fuzz target:
    // the sum overflowed, a panic in debug builds, a write elsewhere in release).
    let Some(status_addr) = last
        .addr
        .checked_add(u64::from(last.len) - 1)
        .map(GuestAddress)
    else {
        tracing::warn!("{} {}: status byte outside guest memory", dev.kind, dev.id);
        return 0;
    };
    let (status, written) = match run(dev, mem, chain).await {
        Ok(n) => (VIRTIO_BLK_S_OK, n),
        Err(Failure::Unsupported) => (VIRTIO_BLK_S_UNSUPP, 0),
        Err(Failure::Io(why)) => {
            if let Some(why) = why {
                tracing::warn!("{} {}: {why}", dev.kind, dev.id);
            }
            (VIRTIO_BLK_S_IOERR, 0)
        }
    };
    if mem.write_obj(status as u8, status_addr).is_err() {
        tracing::warn!("{} {}: status byte outside guest memory", dev.kind, dev.id);
        return 0;
    }
    (written + 1).min(in_len) as u32
}

enum Failure {
    Unsupported,
    /// An I/O error; Some(reason) when it is worth a log line (a malformed request).
    Io(Option<String>),
}

impl From<io::Error> for Failure {
    fn from(_: io::Error) -> Self {
        Failure::Io(None)
    }
}

fn malformed(why: impl Into<String>) -> Failure {
    Failure::Io(Some(why.into()))
}

/// Checks a request range; returns the byte offset.
fn check_range(node: &BlockNode, dev: &BlkDevice, sector: u64, bytes: u64) -> Result<u64, Failure> {
    let lbs = u64::from(dev.logical_block_size);
    let offset = sector
        .checked_mul(512)
        .ok_or_else(|| malformed("sector number overflows"))?;
    let end = offset
        .checked_add(bytes)
        .ok_or_else(|| malformed("request range overflows"))?;
    if end > node.size() {
        return Err(malformed(format!(
            "request [{offset}, {end}) beyond the disk's {} bytes",
            node.size()
        )));
    }
    if !offset.is_multiple_of(lbs) || !bytes.is_multiple_of(lbs) {
        return Err(malformed(format!(
            "request [{offset}, +{bytes}) not aligned to the {lbs}-byte logical block"
        )));
    }
    Ok(offset)
}

/// Bytes of data written to the guest (excluding the status byte), or why it failed.
async fn run(dev: &BlkDevice, mem: &Arc<GuestMemoryMmap>, chain: &Chain) -> Result<u64, Failure> {
    let mut hdr = [0u8; 16];
    if !gather(mem, &chain.out, 0, &mut hdr) {
        return Err(malformed("request header missing or outside guest memory"));
    }
    let kind = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
    // The request runs on the node the export serves now, even if a pivot moves it.
    let node = dev.link.enter().await;
    let node: &BlockNode = &node;
    match kind {
        VIRTIO_BLK_T_IN => read(dev, node, mem, chain, sector).await,
        VIRTIO_BLK_T_OUT => write(dev, node, mem, chain, sector).await,
        VIRTIO_BLK_T_FLUSH => {
            node.flush().await?;
            Ok(0)
        }
        VIRTIO_BLK_T_GET_ID => get_id(dev, mem, chain),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            discard_or_write_zeroes(dev, node, mem, chain, kind).await
        }
        _ => Err(Failure::Unsupported),
    }
}

/// VIRTIO_BLK_T_IN: reads into the device-writable part, straight into guest pages where
/// they allow.
async fn read(
    dev: &BlkDevice,
    node: &BlockNode,
    mem: &Arc<GuestMemoryMmap>,
    chain: &Chain,
    sector: u64,
) -> Result<u64, Failure> {
    let len = chain.data_in_len();
    if len > MAX_REQUEST_BYTES {
        return Err(malformed(format!("read of {len} bytes is too large")));
    }
    let offset = check_range(node, dev, sector, len)?;
    if let Some(iov) = guest_iov(mem, &chain.inn, 0, len) {
        node.readv(offset, iov).await.0?;
        return Ok(len);
    }
    crate::buf::count_bounce();
    let (r, buf) = node.read(offset, request_buf(len as usize)).await;
    r?;
    if !scatter(mem, &chain.inn, &buf) {
        return Err(malformed("read buffer outside guest memory"));
    }
    Ok(len)
}

/// VIRTIO_BLK_T_OUT: writes the device-readable part after the header (FUA while the guest
/// has the write cache off).
async fn write(
    dev: &BlkDevice,
    node: &BlockNode,
    mem: &Arc<GuestMemoryMmap>,
    chain: &Chain,
    sector: u64,
) -> Result<u64, Failure> {
    if !dev.writable {
        return Err(Failure::Io(None));
    }
    let len = chain.out_len() - 16;
    if len > MAX_REQUEST_BYTES {
        return Err(malformed(format!("write of {len} bytes is too large")));
    }
    let offset = check_range(node, dev, sector, len)?;
    let fua = !dev.writeback.load(std::sync::atomic::Ordering::Relaxed);
    if let Some(iov) = guest_iov(mem, &chain.out, 16, len) {
        node.writev(offset, iov, fua).await.0?;
        return Ok(0);
    }
    crate::buf::count_bounce();
    let mut buf = request_buf(len as usize);
    if !gather(mem, &chain.out, 16, &mut buf) {
        return Err(malformed("write buffer outside guest memory"));
    }
    let (r, _) = node.write(offset, buf, fua).await;
    r?;
    Ok(0)
}

/// VIRTIO_BLK_T_GET_ID: the serial number, cut to what the guest's buffer holds.
fn get_id(dev: &BlkDevice, mem: &GuestMemoryMmap, chain: &Chain) -> Result<u64, Failure> {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = dev.serial.len().min(id.len());
    id[..n].copy_from_slice(&dev.serial.as_bytes()[..n]);
    let n = (chain.data_in_len() as usize).min(id.len());
    if !scatter(mem, &chain.inn, &id[..n]) {
        return Err(malformed("id buffer outside guest memory"));
    }
    Ok(n as u64)
}

/// VIRTIO_BLK_T_DISCARD and VIRTIO_BLK_T_WRITE_ZEROES (`kind`): one 16-byte segment
/// (sector, count, flags) after the header.
async fn discard_or_write_zeroes(
    dev: &BlkDevice,
    node: &BlockNode,
    mem: &GuestMemoryMmap,
    chain: &Chain,
    kind: u32,
) -> Result<u64, Failure> {
    if !dev.writable {
        return Err(Failure::Io(None));
    }
    let bytes = chain.out_len() - 16;
    if bytes != 16 {
        return Err(malformed(format!(
            "discard/write-zeroes payload of {bytes} bytes (one 16-byte segment expected)"
        )));
    }
    let mut seg = [0u8; 16];
    if !gather(mem, &chain.out, 16, &mut seg) {
        return Err(malformed("discard segment outside guest memory"));
    }
    let sector = u64::from_le_bytes(seg[0..8].try_into().unwrap());
    let count = u32::from_le_bytes(seg[8..12].try_into().unwrap());
    let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap());
    if count > MAX_DISCARD_SECTORS {
        return Err(malformed(format!(
            "discard of {count} sectors is too large"
        )));
    }
    let len = u64::from(count) * 512;
    let offset = check_range(node, dev, sector, len)?;
    if kind == VIRTIO_BLK_T_DISCARD {
        if flags != 0 {
            return Err(Failure::Unsupported);
        }
        node.discard(offset, len).await?;
    } else {
        let unmap = flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
        node.write_zeroes(offset, len, unmap).await?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_scatter_cross_segments() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        let segs = [
            Segment { addr: 100, len: 3 },
            Segment { addr: 1000, len: 5 },
        ];
        assert!(scatter(&mem, &segs, b"abcdefgh"));
        let mut out = [0u8; 6];
        assert!(gather(&mem, &segs, 2, &mut out));
        assert_eq!(&out, b"cdefgh");
        // Past the end of guest memory.
        assert!(!scatter(
            &mem,
            &[Segment {
                addr: (1 << 16) - 2,
                len: 8
            }],
            b"12345678"
        ));
    }
}
