//! The driver's face to the driver table: [`DRIVER`], whose `open` loads the image
//! ([`Image::load`]) and opens the backing node it names, and the driver built from a
//! loaded image, or built again from the image when it is reloaded.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stord_aio::AsyncMutex;

use super::driver::{Meta, Qcow2Driver};
use super::image::Image;
use super::options::Qcow2Options;
use super::table::TableCache;
use super::{amend, create, data_file};
use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::BlockNode;
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{GraphError, Opened};
use crate::cli::Help;

/// The driver table's entry: a qcow2 image over its `file`; its backing node is
/// `backing=NAME`, inline `backing.driver=...`, none with `backing=null`, else the one the
/// image names (opened read-only, relative to the image's directory, as QEMU does); its
/// external data file, if it has one, `data-file=NAME`, inline `data-file.driver=...`, else
/// the one the image names ([`data_file`](super::data_file)).
pub const DRIVER: DriverDef = DriverDef {
    names: &["qcow2"],
    takes_discard: true,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | file.driver=...\n\
                   [,backing=<node>|null | ,backing.driver=...][,l2-cache-size=<size>]\n\
                   [,data-file=<node> | ,data-file.driver=...]\n\
                   [,refcount-cache-size=<size>][,cache-size=<size>][,discard=unmap|ignore]\n\
                   [,encrypt.format=luks,encrypt.key-secret=<id>]",
        about: "the qcow2 format over its child `file`; the backing file and\n\
                the data file an image names open by themselves unless\n\
                `backing` and `data-file` say otherwise; an encrypted image\n\
                is unlocked with `encrypt.key-secret`",
    },
    create: Some(&create::CREATE),
    amend: Some(&amend::AMEND),
    open: |g, kv, flags| {
        let file = g.child(kv, "file")?;
        let opts = Qcow2Options::from_opts(kv)?;
        let given_data = data_file::given_data_file(g, kv)?;
        let encrypt = super::crypt::take_options(kv)?;
        // A file or data file that cannot be written makes the image read-only.
        let ro = flags.read_only
            || file.is_read_only()
            || given_data.as_ref().is_some_and(|d| d.is_read_only());
        // An inactive image is read as a read-only one; activation reads it again.
        let writes = !ro && !flags.inactive;
        let given = g.optional_child(kv, "backing")?;
        // The file's permissions (its locks) before the image is read and, when writable,
        // written (dirty refcounts repaired, bitmaps marked in use): as QEMU attaches the
        // child before qcow2_open runs. The node takes them for good once it exists.
        let (perm, shared) = crate::block::node::perm::storage_perms(writes);
        let opening = file.claim(flags.node_name, "file", perm, shared)?;
        let f = file.clone();
        let mut image = crate::block::helper_thread::block_on_helper(move || async move {
            Image::load(&f, writes).await
        })
        .and_then(|r| r.map_err(io::Error::other))
        .map_err(|e| GraphError::Invalid(format!("{}: {e}", kv.what)))?;
        let crypt = super::crypt::open(g, encrypt, &image.header, &file)?;
        drop(opening);
        // The one the header names inherits the image's read-only state.
        let data = data_file::open_data_file(g, given_data, &image.header)?;
        let backing = match given {
            Some(b) => b,
            None => match image.header.backing_file.clone() {
                Some(name) => {
                    let fmt = image.header.backing_format.clone();
                    Some(g.backing_file(&file, &name, fmt)?)
                }
                None => None,
            },
        };
        let direct = file.direct;
        let bitmaps = image
            .bitmaps
            .as_mut()
            .map(|l| std::mem::take(&mut l.bitmaps))
            .unwrap_or_default();
        let mut driver = Qcow2Driver::new(file, backing, image, &opts);
        driver.crypt = crypt.map(Box::new);
        Ok(Opened {
            driver: Box::new(driver.with_data_file(data)),
            read_only: ro,
            direct,
            bitmaps,
        })
    },
};

impl Qcow2Driver {
    /// A driver for a loaded image over `file`, reading through to `backing`.
    pub fn new(
        file: Arc<BlockNode>,
        backing: Option<Arc<BlockNode>>,
        image: Image,
        opts: &Qcow2Options,
    ) -> Self {
        let h = image.header.clone();
        let cache = opts.cache_tables(h.size, h.cluster_size(), h.l2_entry_bytes());
        let writable = image.writable;
        let meta = Self::meta_of(image, cache);
        Self {
            file,
            backing_state: (backing.is_some() as u64).into(),
            backing: std::sync::RwLock::new(backing),
            version: h.version,
            cluster_bits: h.cluster_bits,
            cluster_size: h.cluster_size(),
            l2_bits: h.cluster_bits - 3 - u32::from(h.extended_l2()),
            extended_l2: h.extended_l2(),
            subcluster_bits: h.cluster_bits - 5 * u32::from(h.extended_l2()),
            refcount_order: h.refcount_order,
            size: h.size.into(),
            discard: opts.discard,
            meta: AsyncMutex::new(meta),
            cache,
            alloc_locks: RangeLocks::default(),
            io_inflight: AtomicUsize::new(0),
            incompatible: h.incompatible,
            compression: h.compression,
            corrupt: Default::default(),
            writable: writable.into(),
            data: None,
            crypt: None,
        }
    }

    /// The metadata state of a loaded image, with caches of `(l2, refcount)` tables.
    fn meta_of(image: Image, (l2_tables, rc_tables): (usize, usize)) -> Meta {
        let h = image.header;
        // Contiguous metadata goes past every cluster the refcounts count and every table
        // this open found (an image whose refcounts undercount its metadata must not get
        // it overwritten).
        let used_end = image.used_end.max(
            image
                .regions
                .last_key_value()
                .map_or(0, |(&c, _)| (c + 1) << h.cluster_bits),
        );
        Meta {
            regions: image.regions,
            l1: image.l1,
            l1_offset: h.l1_table_offset,
            reftable_offset: h.refcount_table_offset,
            l1_dirty: Default::default(),
            l2: TableCache::new(l2_tables),
            reftable: image.reftable.iter().map(|e| e & !511).collect(),
            reftable_dirty: Default::default(),
            refblocks: TableCache::new(rc_tables),
            free_hint: 0,
            file_end: image.file_end,
            used_end,
            pending_free: Vec::new(),
            free_byte_offset: 0,
            needs_sync: false,
            bitmap_dir: image.bitmaps.map(|l| l.dir).unwrap_or_default(),
        }
    }

    /// Reads the image's metadata again, as a fresh open would (QEMU's invalidate-cache):
    /// with `writable`, for writing (refused images refused, dirty refcounts repaired,
    /// other autoclear bits cleared). What was cached goes; the caller made sure nothing
    /// was written through this driver since its last flush (it was read-only, or
    /// inactive). Images with persistent bitmaps are refused: their bitmaps live in the
    /// node, which a reload does not replace.
    pub async fn reload(&self, writable: bool) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        let refuse = || io::Error::other("stord cannot reload an image with persistent bitmaps");
        if !m.bitmap_dir.entries.is_empty() {
            return Err(refuse());
        }
        // Read first as it is: a load for writing would already mark bitmaps in use.
        let probe = Image::load(&self.file, false)
            .await
            .map_err(io::Error::other)?;
        if probe.bitmaps.is_some() {
            return Err(refuse());
        }
        let image = if writable {
            Image::load(&self.file, true)
                .await
                .map_err(io::Error::other)?
        } else {
            probe
        };
        let h = &image.header;
        if h.cluster_bits != self.cluster_bits
            || h.refcount_order != self.refcount_order
            || h.extended_l2() != self.extended_l2
            || h.compression != self.compression
            || h.crypto_header != self.crypt.as_ref().map(|c| c.header)
        {
            return Err(io::Error::other("the image's layout changed"));
        }
        self.size.store(h.size, Ordering::Relaxed);
        *m = Self::meta_of(image, self.cache);
        self.writable.store(writable, Ordering::Relaxed);
        Ok(())
    }
}
