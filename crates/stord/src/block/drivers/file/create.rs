//! Creating a file (`blockdev-create` of `driver=file`, `blockdev-snapshot-sync`'s
//! overlays), as QEMU's file-posix does: opened (created if missing) with the write and
//! resize locks taken and checked first, so an image another process has open is never
//! truncated; then cut to 0 and set to its size.

use std::os::fd::AsRawFd;

use super::lock::ImageLock;
use crate::block::create::{CreateDef, Prealloc, PREALLOC_MODE};
use crate::block::node::perm::Perm;
use crate::schema::{opt, req, Ty};

/// `blockdev-create`'s part for `driver=file` (QEMU's BlockdevCreateOptionsFile).
pub const CREATE: CreateDef = CreateDef {
    args: &[
        req("filename", Ty::Str),
        req("size", Ty::Uint),
        opt("preallocation", Ty::Enum(&PREALLOC_MODE)),
        opt("nocow", Ty::Bool),
        opt("extent-size-hint", Ty::Uint),
    ],
    prepare: |mut kv, _| {
        let o = FileCreate {
            prealloc: Prealloc::take(&mut kv)?,
            filename: kv.take_required("filename")?,
            size: kv.take_u64("size", false)?.unwrap_or(0),
        };
        // Hints for filesystems that have them; stord's files get neither (as QEMU's on
        // most filesystems).
        kv.take("nocow");
        kv.take("extent-size-hint");
        kv.finish()?;
        // A worker thread's: `full` writes the whole file.
        Ok(Box::pin(async move {
            crate::block::worker_pool::run(move || create_file(&o)).await
        }))
    },
};

/// `blockdev-create` of `driver=file`.
#[derive(Debug, Clone)]
pub struct FileCreate {
    pub filename: String,
    pub size: u64,
    /// `off`, `falloc` or `full` (a file has no metadata to preallocate).
    pub prealloc: Prealloc,
}

/// Creates (or cuts and resizes) the file.
pub fn create_file(o: &FileCreate) -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&o.filename)
        .map_err(|e| format!("Could not create '{}': {e}", o.filename))?;
    // QEMU's raw_co_create: write and resize taken, resize not shared, checked against
    // other openers before the file is touched.
    let lock = ImageLock::new(true, &o.filename);
    lock.set(
        f.as_raw_fd(),
        Perm::WRITE | Perm::RESIZE,
        Perm::ALL & Perm::RESIZE.complement(),
    )
    .map_err(|e| e.to_string())?;
    f.set_len(0)
        .and_then(|()| f.set_len(o.size))
        .map_err(|e| format!("Could not resize file: {e}"))?;
    match o.prealloc {
        Prealloc::Off => {}
        Prealloc::Falloc if o.size > 0 => crate::sys::fallocate(f.as_raw_fd(), 0, 0, o.size)
            .map_err(|e| format!("Could not preallocate data for the new file: {e}"))?,
        Prealloc::Falloc => {}
        Prealloc::Full => write_zeroes(&f, o.size)
            .map_err(|e| format!("Could not write zeros for preallocation: {e}"))?,
        Prealloc::Metadata => {
            return Err(format!(
                "Unsupported preallocation mode: {}",
                o.prealloc.name()
            ))
        }
    }
    Ok(())
}

/// `preallocation=full`: zeroes written over the whole file, a MiB at a time, then synced
/// (QEMU's handle_aiocb_truncate).
fn write_zeroes(f: &std::fs::File, size: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let zeroes = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < size {
        let n = (size - at).min(zeroes.len() as u64) as usize;
        f.write_all_at(&zeroes[..n], at)?;
        at += n as u64;
    }
    f.sync_all()
}
