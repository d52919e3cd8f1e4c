//! The FUSE kernel ABI we use: opcodes, flags and the byte layout of the messages.
//!
//! Messages are parsed and built field by field (little-endian, as on every Linux target
//! we run on) instead of transmuting structs, so this file has no `unsafe`.

pub const IN_HEADER: usize = 40;
pub const OUT_HEADER: usize = 16;

pub const FUSE_KERNEL_VERSION: u32 = 7;
/// The minor version we speak (our INIT reply has the 7.36+ 64-byte layout).
pub const FUSE_KERNEL_MINOR: u32 = 41;
/// The kernel refuses reads into buffers smaller than this.
pub const FUSE_MIN_READ_BUFFER: usize = 8192;

pub const LOOKUP: u32 = 1;
pub const FORGET: u32 = 2;
pub const GETATTR: u32 = 3;
pub const SETATTR: u32 = 4;
pub const OPEN: u32 = 14;
pub const READ: u32 = 15;
pub const WRITE: u32 = 16;
pub const STATFS: u32 = 17;
pub const RELEASE: u32 = 18;
pub const FSYNC: u32 = 20;
pub const FLUSH: u32 = 25;
pub const INIT: u32 = 26;
pub const INTERRUPT: u32 = 36;
pub const DESTROY: u32 = 38;
pub const BATCH_FORGET: u32 = 42;
pub const FALLOCATE: u32 = 43;
pub const LSEEK: u32 = 46;

// INIT flags.
pub const ASYNC_READ: u64 = 1 << 0;
pub const BIG_WRITES: u64 = 1 << 5;
pub const ASYNC_DIO: u64 = 1 << 15;
pub const MAX_PAGES: u64 = 1 << 22;

// SETATTR valid bits.
pub const FATTR_MODE: u32 = 1 << 0;
pub const FATTR_UID: u32 = 1 << 1;
pub const FATTR_GID: u32 = 1 << 2;
pub const FATTR_SIZE: u32 = 1 << 3;
pub const FATTR_ATIME: u32 = 1 << 4;
pub const FATTR_MTIME: u32 = 1 << 5;
pub const FATTR_FH: u32 = 1 << 6;
pub const FATTR_ATIME_NOW: u32 = 1 << 7;
pub const FATTR_MTIME_NOW: u32 = 1 << 8;
pub const FATTR_LOCKOWNER: u32 = 1 << 9;
pub const FATTR_CTIME: u32 = 1 << 10;
pub const FATTR_KILL_SUIDGID: u32 = 1 << 11;

// OPEN reply flags.
pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

/// The inode number of the one file (the mount root).
pub const ROOT_INODE: u64 = 1;

/// Reads little-endian integers out of a message.
pub struct Fields<'a>(pub &'a [u8]);

impl Fields<'_> {
    pub fn u32(&self, off: usize) -> Option<u32> {
        Some(u32::from_le_bytes(
            self.0.get(off..off + 4)?.try_into().ok()?,
        ))
    }
    pub fn u64(&self, off: usize) -> Option<u64> {
        Some(u64::from_le_bytes(
            self.0.get(off..off + 8)?.try_into().ok()?,
        ))
    }
}

/// The request header.
#[derive(Debug, Clone, Copy)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Option<Self> {
        let f = Fields(b);
        Some(Self {
            len: f.u32(0)?,
            opcode: f.u32(4)?,
            unique: f.u64(8)?,
        })
    }
}

/// The out header of a reply with a `body_len`-byte body.
pub fn reply(unique: u64, error: i32, body_len: usize) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    h[0..4].copy_from_slice(&((OUT_HEADER + body_len) as u32).to_le_bytes());
    h[4..8].copy_from_slice(&error.to_le_bytes());
    h[8..16].copy_from_slice(&unique.to_le_bytes());
    h
}

/// The attributes of the one file (`fuse_attr`, 88 bytes).
pub struct Attr {
    pub size: u64,
    pub blocks: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub blksize: u32,
    pub time_s: u64,
    pub time_ns: u32,
}

impl Attr {
    pub fn put(&self, v: &mut Vec<u8>) {
        v.extend_from_slice(&ROOT_INODE.to_le_bytes());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.blocks.to_le_bytes());
        for _ in 0..3 {
            v.extend_from_slice(&self.time_s.to_le_bytes()); // atime, mtime, ctime
        }
        for _ in 0..3 {
            v.extend_from_slice(&self.time_ns.to_le_bytes());
        }
        v.extend_from_slice(&self.mode.to_le_bytes());
        v.extend_from_slice(&1u32.to_le_bytes()); // nlink
        v.extend_from_slice(&self.uid.to_le_bytes());
        v.extend_from_slice(&self.gid.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes()); // rdev
        v.extend_from_slice(&self.blksize.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes()); // flags
    }
}

// FUSE over io_uring.
/// INIT flag: flags2 is valid.
pub const INIT_EXT: u64 = 1 << 30;
/// INIT flags2 bit (1 << 41 overall): serve requests through io_uring.
pub const OVER_IO_URING_FLAGS2: u32 = 1 << (41 - 32);
/// URING_CMD command: register an entry (and wait for a request).
pub const URING_CMD_REGISTER: u32 = 1;
/// URING_CMD command: commit a reply and wait for the next request.
pub const URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// Layout of `struct fuse_uring_req_header`: in/out header area, op struct area, ent_in_out.
pub const URING_HDR_IN_OUT: usize = 0;
pub const URING_HDR_OP_IN: usize = 128;
pub const URING_HDR_ENT: usize = 256;
pub const URING_HDR_LEN: usize = 288;
