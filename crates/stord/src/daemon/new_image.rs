//! Images a command creates by file name (blockdev-snapshot-sync's overlay, drive-backup's
//! and drive-mirror's targets), as QEMU's bdrv_img_create makes them: qcow2 (version 3,
//! 64 KiB clusters, naming its backing file and format if it has one) or raw, and the
//! format of an existing image as QEMU's probe tells qcow2 from raw.

use std::sync::Arc;

use super::error::{invalid, DaemonError};
use crate::block::create::Prealloc;
use crate::block::drivers::file;
use crate::block::drivers::file::create::{create_file, FileCreate};
use crate::block::drivers::file::{AioMode, FileOptions};
use crate::block::drivers::qcow2::create::{create_qcow2, Qcow2Create};
use crate::block::node::block_node::BlockNode;

/// Creates `path` in `format`, `size` bytes, backed by `backing` (file name, format).
pub(super) fn create_image(
    path: &str,
    format: &str,
    size: u64,
    backing: Option<(String, String)>,
) -> Result<(), DaemonError> {
    match format {
        "qcow2" => {}
        "raw" if backing.is_some() => {
            return Err(invalid("Backing file not supported for file format 'raw'"))
        }
        "raw" => {
            return create_file(&FileCreate {
                filename: path.to_string(),
                size,
                prealloc: Prealloc::Off,
            })
            .map_err(DaemonError::Invalid)
        }
        other => {
            return Err(invalid(format!(
                "Format driver '{other}' does not support image creation"
            )))
        }
    }
    create_file(&FileCreate {
        filename: path.to_string(),
        size: 0,
        prealloc: Prealloc::Off,
    })
    .map_err(DaemonError::Invalid)?;
    let opts = FileOptions {
        filename: path.to_string(),
        aio: AioMode::Threads,
        direct: false,
        native: file::NativeTuning {
            max_batch: 0,
            reap_after_submit: true,
        },
        discard: file::DiscardMode::Ignore,
        read_only: false,
        locking: true,
        no_flush: false,
    };
    // The file driver's own open error already reads "Could not open 'P': ...".
    let driver = file::open(opts).map_err(|e| {
        let text = e.to_string();
        invalid(if text.starts_with("Could not open ") {
            text
        } else {
            format!("Could not open '{path}': {}", crate::sys::os_text(&e))
        })
    })?;
    let node = Arc::new(BlockNode::new("new-image".into(), driver, false, false));
    let (backing_file, backing_fmt) = backing.unzip();
    let q = Qcow2Create {
        size,
        v3: true,
        cluster_size: 65536,
        refcount_bits: 16,
        lazy_refcounts: false,
        backing_file,
        backing_fmt,
        zstd: false,
        extended_l2: false,
    };
    let r = crate::block::helper_thread::block_on_helper(move || async move {
        create_qcow2(&node, &q).await
    });
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) | Err(e) => Err(invalid(format!("Could not create '{path}': {e}"))),
    }
}

/// The format of the image at `path` as QEMU's probe names it here: qcow2 by its magic,
/// else raw.
pub(super) fn probe_format(path: &str) -> Result<&'static str, DaemonError> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| {
        invalid(format!(
            "Could not open '{path}': {}",
            crate::sys::os_text(&e)
        ))
    })?;
    let n = f.read(&mut magic).unwrap_or(0);
    Ok(if n == 4 && magic == *b"QFI\xfb" {
        "qcow2"
    } else {
        "raw"
    })
}
