//! What each FUSE request does, independent of the transport (/dev/fuse or io_uring).
//! Opcodes and semantics follow qemu-storage-daemon's FUSE export.

use std::io;
use std::sync::atomic::Ordering;

use super::proto::*;
use super::shared::{FuseShared, MAX_READ};
use crate::buf::{request_buf, Buf};

/// A reply body.
pub enum Body {
    /// Bytes built here.
    Bytes(Vec<u8>),
    /// Data read from the node.
    Data(Buf),
}

impl Body {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Body::Bytes(v) => v,
            Body::Data(b) => b,
        }
    }
}

/// A handled request: what to send back.
pub struct Processed {
    pub unique: u64,
    pub opcode: u32,
    pub result: Result<Body, i32>,
}

impl FuseShared {
    /// Handles one request (`msg` = in header + op struct + payload). None: no reply.
    pub async fn process(&self, msg: &[u8]) -> Option<Processed> {
        let h = InHeader::parse(msg)?;
        if h.len as usize != msg.len() {
            // The kernel never sends this; treat the channel as broken, as qsd does.
            self.halted.store(true, Ordering::SeqCst);
            return None;
        }
        let body = &msg[IN_HEADER.min(msg.len())..];
        let f = Fields(body);
        let done = |result| {
            Some(Processed {
                unique: h.unique,
                opcode: h.opcode,
                result,
            })
        };
        let r = match h.opcode {
            INIT => return done(self.init(&f)),
            FORGET | BATCH_FORGET | INTERRUPT => return None,
            LOOKUP => Err(libc::ENOENT),
            GETATTR => Ok(self.attr_out()),
            SETATTR => self.setattr(&f).await,
            OPEN => {
                let mut v = Vec::with_capacity(16);
                v.extend_from_slice(&0u64.to_le_bytes());
                v.extend_from_slice(
                    &(FOPEN_DIRECT_IO | FOPEN_PARALLEL_DIRECT_WRITES).to_le_bytes(),
                );
                v.extend_from_slice(&0u32.to_le_bytes());
                Ok(v)
            }
            RELEASE | DESTROY => Ok(Vec::new()),
            READ => return done(self.read(&f).await),
            WRITE => self.write(&f, body).await,
            FSYNC | FLUSH => self
                .link
                .enter()
                .await
                .flush()
                .await
                .map(|()| Vec::new())
                .map_err(errno),
            FALLOCATE => self.fallocate(&f).await,
            LSEEK => self.lseek(&f).await,
            STATFS => Ok(self.statfs()),
            _ => Err(libc::ENOSYS),
        };
        done(r.map(Body::Bytes))
    }

    fn init(&self, f: &Fields<'_>) -> Result<Body, i32> {
        let (Some(major), Some(minor), Some(flags)) = (f.u32(0), f.u32(4), f.u32(12)) else {
            return Err(libc::EINVAL);
        };
        if major != FUSE_KERNEL_VERSION || minor < 23 {
            return Err(libc::EPROTO);
        }
        let want = (ASYNC_READ | ASYNC_DIO | BIG_WRITES | MAX_PAGES) as u32;
        let max_write = self.max_write;
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&FUSE_KERNEL_VERSION.to_le_bytes());
        v.extend_from_slice(&FUSE_KERNEL_MINOR.min(minor).to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes()); // max_readahead
                                                  // FUSE over io_uring is offered in flags2 (bit 41 overall) when the kernel has it
                                                  // enabled; we take it if the export asked for it.
        let flags2 = if minor >= 36 && flags as u64 & INIT_EXT != 0 {
            f.u32(16).unwrap_or(0)
        } else {
            0
        };
        let uring = self.want_uring && flags2 & OVER_IO_URING_FLAGS2 != 0;
        self.uring_granted.store(uring, Ordering::SeqCst);
        let (flags_out, flags2_out) = if uring {
            ((flags & want) | INIT_EXT as u32, OVER_IO_URING_FLAGS2)
        } else {
            (flags & want, 0)
        };
        v.extend_from_slice(&flags_out.to_le_bytes());
        v.extend_from_slice(&u16::MAX.to_le_bytes()); // max_background
        v.extend_from_slice(&49151u16.to_le_bytes()); // congestion_threshold
        v.extend_from_slice(&max_write.to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes()); // time_gran
        v.extend_from_slice(&(max_write.div_ceil(4096) as u16).to_le_bytes()); // max_pages
        v.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
        v.extend_from_slice(&flags2_out.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes()); // max_stack_depth
        v.extend_from_slice(&[0u8; 24]); // unused
        self.initialized.store(true, Ordering::SeqCst);
        Ok(Body::Bytes(v))
    }

    fn attr_out(&self) -> Vec<u8> {
        let s = self;
        let node = s.link.current();
        let size = node.size();
        let blocks = s.allocated_bytes().div_ceil(512);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let attr = Attr {
            size,
            blocks,
            mode: s.mode.load(Ordering::Relaxed),
            uid: s.uid,
            gid: s.gid,
            blksize: if node.direct { 4096 } else { 512 },
            time_s: now.as_secs(),
            time_ns: now.subsec_nanos(),
        };
        let mut v = Vec::with_capacity(104);
        v.extend_from_slice(&1u64.to_le_bytes()); // attr_valid: 1 s
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        attr.put(&mut v);
        v
    }

    async fn setattr(&self, f: &Fields<'_>) -> Result<Vec<u8>, i32> {
        let node = self.link.enter().await;
        let s = self;
        let valid = f.u32(0).ok_or(libc::EINVAL)?;
        let supported = FATTR_SIZE | FATTR_MODE | FATTR_UID | FATTR_GID;
        let ignored = FATTR_FH
            | FATTR_LOCKOWNER
            | FATTR_KILL_SUIDGID
            | FATTR_ATIME
            | FATTR_MTIME
            | FATTR_ATIME_NOW
            | FATTR_MTIME_NOW
            | FATTR_CTIME;
        if valid & !(supported | ignored) != 0 {
            return Err(libc::ENOTSUP);
        }
        if valid & (FATTR_UID | FATTR_GID) != 0 && !s.allow_other {
            return Err(libc::ENOTSUP);
        }
        if valid & FATTR_MODE != 0 {
            let mode = f.u32(68).ok_or(libc::EINVAL)?;
            if mode & 0o077 != 0 && !s.allow_other {
                return Err(libc::EPERM);
            }
            if mode & 0o222 != 0 && !s.writable {
                return Err(libc::EROFS);
            }
            s.mode
                .store((mode & 0o7777) | libc::S_IFREG, Ordering::Relaxed);
        }
        if valid & FATTR_SIZE != 0 {
            let size = f.u64(16).ok_or(libc::EINVAL)?;
            if !s.writable {
                return Err(libc::EACCES);
            }
            if size > node.size() && !s.growable {
                return Err(libc::EPERM);
            }
            node.resize(size).await.map_err(errno)?;
        }
        Ok(self.attr_out())
    }

    async fn read(&self, f: &Fields<'_>) -> Result<Body, i32> {
        let size = f.u32(16).ok_or(libc::EINVAL)?.min(MAX_READ) as usize;
        let (r, buf) = self.read_into(f, request_buf(size)).await;
        r.map(|_| Body::Data(buf))
    }

    /// READ into `buf` (whose capacity must cover the request): on success `buf` holds
    /// exactly the bytes to return (clamped at the end of the image).
    pub async fn read_into(&self, f: &Fields<'_>, mut buf: Buf) -> (Result<usize, i32>, Buf) {
        let node = self.link.enter().await;
        let (Some(offset), Some(size)) = (f.u64(8), f.u32(16)) else {
            return (Err(libc::EINVAL), buf);
        };
        if size > MAX_READ || size as usize > buf.capacity() {
            return (Err(libc::EINVAL), buf);
        }
        let len = node.size();
        if offset >= len || size == 0 {
            buf.set_len(0);
            return (Ok(0), buf);
        }
        let n = (size as u64).min(len - offset) as usize;
        buf.set_len(n);
        let (r, buf): (io::Result<()>, Buf) = node.read(offset, buf).await;
        (r.map(|()| n).map_err(errno), buf)
    }

    async fn write(&self, f: &Fields<'_>, body: &[u8]) -> Result<Vec<u8>, i32> {
        let size = f.u32(16).ok_or(libc::EINVAL)? as usize;
        const WRITE_IN: usize = 40;
        if body.len() < WRITE_IN + size {
            return Err(libc::EINVAL);
        }
        let mut buf = request_buf(size);
        buf.copy_from_slice(&body[WRITE_IN..WRITE_IN + size]);
        let n = self.write_from(f, buf).await.0?;
        Ok(write_out(n))
    }

    /// WRITE of `buf` (holding the request's data): the count written.
    pub async fn write_from(&self, f: &Fields<'_>, mut buf: Buf) -> (Result<u32, i32>, Buf) {
        let node = self.link.enter().await;
        let (Some(offset), Some(size)) = (f.u64(8), f.u32(16)) else {
            return (Err(libc::EINVAL), buf);
        };
        let size = size as usize;
        if size > buf.len() {
            return (Err(libc::EINVAL), buf);
        }
        if !self.writable {
            return (Err(libc::EACCES), buf);
        }
        let Some(end) = offset.checked_add(size as u64) else {
            return (Err(libc::EINVAL), buf);
        };
        let mut n = size;
        if end > node.size() {
            if self.growable {
                if let Err(e) = node.resize(end).await {
                    return (Err(errno(e)), buf);
                }
            } else if offset >= node.size() {
                return (Err(libc::ENOSPC), buf);
            } else {
                n = (node.size() - offset) as usize;
            }
        }
        buf.set_len(n);
        let (r, buf) = node.write(offset, buf, self.writethrough).await;
        (r.map(|()| n as u32).map_err(errno), buf)
    }

    async fn fallocate(&self, f: &Fields<'_>) -> Result<Vec<u8>, i32> {
        let node = self.link.enter().await;
        let s = self;
        let (offset, length, mode) = (
            f.u64(8).ok_or(libc::EINVAL)?,
            f.u64(16).ok_or(libc::EINVAL)?,
            f.u32(24).ok_or(libc::EINVAL)? as i32,
        );
        if !s.writable {
            return Err(libc::EACCES);
        }
        let size = node.size();
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let end = offset.checked_add(length).ok_or(libc::EINVAL)?;
        let clamp = |end: u64| end.min(size);
        if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
            if !keep {
                return Err(libc::EINVAL);
            }
            if offset < size {
                node.write_zeroes(offset, clamp(end) - offset, true)
                    .await
                    .map_err(errno)?;
            }
        } else if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
            if !keep && end > size {
                if !s.growable {
                    return Err(libc::EPERM);
                }
                node.resize(end).await.map_err(errno)?;
            }
            let size = node.size();
            if offset < size {
                node.write_zeroes(offset, end.min(size) - offset, false)
                    .await
                    .map_err(errno)?;
            }
        } else if mode == 0 {
            // As qsd: only at or past the end, by growing with the new area allocated
            // (preallocation=falloc); a gap before it is not allocated.
            if offset < size {
                return Err(libc::EOPNOTSUPP);
            }
            if !s.growable {
                return Err(libc::EPERM);
            }
            if offset > size {
                node.resize(offset).await.map_err(errno)?;
            }
            node.resize_preallocated(end).await.map_err(errno)?;
        } else {
            return Err(libc::EOPNOTSUPP);
        }
        Ok(Vec::new())
    }

    async fn lseek(&self, f: &Fields<'_>) -> Result<Vec<u8>, i32> {
        let node = self.link.enter().await;
        let offset = f.u64(8).ok_or(libc::EINVAL)?;
        let whence = f.u32(16).ok_or(libc::EINVAL)? as i32;
        if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
            return Err(libc::EINVAL);
        }
        let len = node.size();
        if offset >= len {
            return Err(libc::ENXIO);
        }
        let mut pos = offset;
        loop {
            if pos >= len {
                // The end of the image counts as a hole; there is no data past it.
                if whence == libc::SEEK_DATA {
                    return Err(libc::ENXIO);
                }
                return Ok(len.to_le_bytes().to_vec());
            }
            let st = node.block_status(pos, len - pos).await.map_err(errno)?;
            // Allocated extents are data (even if they read as zeroes), as for SEEK_DATA on
            // the backing file; unallocated ones are holes.
            if (whence == libc::SEEK_DATA) == st.allocated {
                return Ok(pos.to_le_bytes().to_vec());
            }
            pos += st.len;
        }
    }

    fn statfs(&self) -> Vec<u8> {
        let s = self;
        let blocks = s.link.current().size().div_ceil(512);
        let mut v = Vec::with_capacity(80);
        v.extend_from_slice(&blocks.to_le_bytes());
        v.extend_from_slice(&0u64.to_le_bytes()); // bfree
        v.extend_from_slice(&0u64.to_le_bytes()); // bavail
        v.extend_from_slice(&1u64.to_le_bytes()); // files
        v.extend_from_slice(&0u64.to_le_bytes()); // ffree
        v.extend_from_slice(&512u32.to_le_bytes()); // bsize
        v.extend_from_slice(&255u32.to_le_bytes()); // namelen
        v.extend_from_slice(&512u32.to_le_bytes()); // frsize
        v.extend_from_slice(&[0u8; 28]); // padding + spare
        v
    }
}

/// `fuse_write_out`.
pub fn write_out(n: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(8);
    v.extend_from_slice(&n.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v
}

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}
