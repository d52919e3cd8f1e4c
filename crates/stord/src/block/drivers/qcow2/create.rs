//! Creating a qcow2 image (`blockdev-create`, `blockdev-snapshot-sync`): written on an
//! opened node: header (version 3 with compression type, or 2; extended L2 entries on
//! request), one refcount table, the refcount blocks and an empty L1 table for the
//! virtual size, then an encrypted image's LUKS header ([`super::create_crypt`]), every
//! metadata cluster counted once; `qemu-img check` finds it clean.
//!
//! With an external data file (`data-file`, a node) the header names it and the data file
//! is sized to the disk, as QEMU's qcow2_co_create and its truncate do; `data-file-raw`
//! (or `preallocation=metadata`) also maps every cluster to its offset there, in L2 tables
//! that follow the L1 table (QEMU's metadata preallocation), so the data file reads as the
//! disk by itself.

use std::io;
use std::sync::Arc;

use crate::block::create::{
    resize_allocated, unsupported, CreateDef, CreateEnv, Creation, Prealloc, PREALLOC_MODE,
};
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;
use crate::crypto::luks::create::Created;
use crate::schema::{opt, req, EnumType, Ty};

static VERSION: EnumType = EnumType {
    name: "BlockdevQcow2Version",
    values: || vec!["v2", "v3"],
};

static COMPRESSION_TYPE: EnumType = EnumType {
    name: "Qcow2CompressionType",
    values: || vec!["zlib", "zstd"],
};

/// `blockdev-create`'s part for `driver=qcow2` (QEMU's BlockdevCreateOptionsQcow2): the
/// image is written on the node `file` names.
pub const CREATE: CreateDef = CreateDef {
    args: &[
        req("file", Ty::Any),
        req("size", Ty::Uint),
        opt("data-file", Ty::Any),
        opt("data-file-raw", Ty::Bool),
        opt("extended-l2", Ty::Bool),
        opt("version", Ty::Enum(&VERSION)),
        opt("backing-file", Ty::Str),
        opt("backing-fmt", Ty::Str),
        opt("encrypt", Ty::Any),
        opt("cluster-size", Ty::Uint),
        opt("preallocation", Ty::Enum(&PREALLOC_MODE)),
        opt("lazy-refcounts", Ty::Bool),
        opt("refcount-bits", Ty::Uint),
        opt("compression-type", Ty::Enum(&COMPRESSION_TYPE)),
    ],
    prepare,
};

fn prepare(mut kv: KeyVal, env: &dyn CreateEnv) -> Result<Creation, GraphError> {
    // QMP's `file` is a node name or an inline node (flattened to `file.driver=...`).
    let Some(file) = kv.take("file") else {
        return Err(unsupported("an inline 'file' (name a node)"));
    };
    let encrypt = super::create_crypt::take_options(&mut kv, env)?;
    let data = DataFileOptions::take(&mut kv)?;
    let opts = Qcow2Create {
        size: kv.take_u64("size", false)?.unwrap_or(0),
        v3: kv.take("version").as_deref() != Some("v2"),
        cluster_size: kv.take_u64("cluster-size", false)?.unwrap_or(65536),
        refcount_bits: kv.take_u64("refcount-bits", false)?.unwrap_or(16),
        lazy_refcounts: kv.take_bool("lazy-refcounts", false)?,
        backing_file: kv.take("backing-file"),
        backing_fmt: kv.take("backing-fmt"),
        zstd: kv.take("compression-type").as_deref() == Some("zstd"),
        extended_l2: kv.take_bool("extended-l2", false)?,
    };
    kv.finish()?;
    // Looked up now, while the graph is at hand; as in QEMU a missing node fails the job
    // (after QEMU's checks of the values), not the command.
    let node = env.node(&file);
    let data_node = data.node.as_ref().map(|n| (n.clone(), env.node(n)));
    Ok(Box::pin(async move {
        opts.check()?;
        data.check(&opts)?;
        let not_found = |n: &str| format!("Cannot find device='{n}' nor node-name='{n}'");
        let Some(node) = node else {
            return Err(not_found(&file));
        };
        let new_data = match data_node {
            None => None,
            Some((name, None)) => return Err(not_found(&name)),
            Some((_, Some(d))) => Some(NewDataFile {
                name: d.filename().unwrap_or_default(),
                node: d,
                raw: data.raw,
                prealloc: data.prealloc,
            }),
        };
        let crypt = match encrypt {
            Some(e) => Some(e.make().await?),
            None => None,
        };
        let prealloc = data.prealloc;
        create_image(&node, &opts, new_data.as_ref(), crypt.as_ref(), prealloc)
            .await
            .map_err(|e| e.to_string())
    }))
}

/// `blockdev-create`'s options for an external data file, as given.
struct DataFileOptions {
    /// `data-file`: the node's name.
    node: Option<String>,
    raw: bool,
    /// `preallocation`: with a data file, for the data file; without, for the image.
    prealloc: Prealloc,
}

impl DataFileOptions {
    /// Takes `data-file`, `data-file-raw` and `preallocation`.
    fn take(kv: &mut KeyVal) -> Result<Self, GraphError> {
        if kv.take_prefixed("data-file").is_some() {
            return Err(unsupported("an inline 'data-file' (name a node)"));
        }
        let node = kv.take("data-file");
        let raw = kv.take_bool("data-file-raw", false)?;
        let prealloc = Prealloc::take(kv)?;
        Ok(Self {
            node,
            raw,
            prealloc,
        })
    }

    /// QEMU's checks and texts (qcow2_co_create), after those of [`Qcow2Create::check`].
    fn check(&self, o: &Qcow2Create) -> Result<(), String> {
        if o.backing_file.is_some() && self.prealloc != Prealloc::Off && !o.extended_l2 {
            return Err("Backing file and preallocation can only be used at the same time if extended_l2 is on".into());
        }
        if self.raw && self.node.is_none() {
            return Err("data-file-raw requires data-file".into());
        }
        if self.raw && o.backing_file.is_some() {
            return Err("Backing file and data-file-raw cannot be used at the same time".into());
        }
        if self.node.is_some() && !o.v3 {
            return Err("External data files are only supported with compatibility level 1.1 and above (use version=v3 or greater)".into());
        }
        Ok(())
    }
}

/// The external data file of an image being created.
pub struct NewDataFile {
    /// The node the guest data goes to.
    pub node: Arc<BlockNode>,
    /// The name the header gives it (QEMU writes the node's file name).
    pub name: String,
    /// `data-file-raw`: the data file reads as the disk by itself.
    pub raw: bool,
    /// `preallocation` for the data file: any but `off` (which `data-file-raw` implies
    /// is `metadata`) maps every cluster to its own offset there.
    pub prealloc: Prealloc,
}

impl NewDataFile {
    /// Every cluster mapped one to one (QEMU's metadata preallocation).
    fn mapped(&self) -> bool {
        self.raw || self.prealloc != Prealloc::Off
    }
}

/// `blockdev-create` of `driver=qcow2` (the options QEMU checks before it starts the job
/// are checked by [`Qcow2Create::check`]).
#[derive(Debug, Clone)]
pub struct Qcow2Create {
    pub size: u64,
    /// Version 3 (compat 1.1), else 2 (compat 0.10).
    pub v3: bool,
    pub cluster_size: u64,
    pub refcount_bits: u64,
    pub lazy_refcounts: bool,
    pub backing_file: Option<String>,
    pub backing_fmt: Option<String>,
    pub zstd: bool,
    /// Extended L2 entries (subclusters).
    pub extended_l2: bool,
}

impl Qcow2Create {
    /// QEMU's checks and texts (qcow2_co_create).
    pub fn check(&self) -> Result<(), String> {
        if !self.size.is_multiple_of(512) {
            return Err("Image size must be a multiple of 512 bytes".into());
        }
        if self.extended_l2 && !self.v3 {
            return Err("Extended L2 entries are only supported with compatibility level 1.1 and above (use version=v3 or greater)".into());
        }
        let cs = self.cluster_size;
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            return Err("Cluster size must be a power of two between 512 and 2048k".into());
        }
        if self.extended_l2 && cs < 16384 {
            return Err(
                "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes"
                    .into(),
            );
        }
        if !self.refcount_bits.is_power_of_two() || self.refcount_bits > 64 {
            return Err("Refcount width must be a power of two and may not exceed 64 bits".into());
        }
        if !self.v3 && self.refcount_bits != 16 {
            return Err("Different refcount widths than 16 bits require compatibility level 1.1 or above (use version=v3 or greater)".into());
        }
        if !self.v3 && self.lazy_refcounts {
            return Err("Lazy refcounts only supported with compatibility level 1.1 and above (use version=v3 or greater)".into());
        }
        if !self.v3 && self.zstd {
            return Err("Non-zlib compression type is only supported with compatibility level 1.1 and above (use version=v3 or greater)".into());
        }
        if self.backing_fmt.is_some() && self.backing_file.is_none() {
            return Err("Backing format cannot be used without backing file".into());
        }
        Ok(())
    }
}

/// Where the metadata of a new image goes, in clusters from the start: the header, the
/// refcount table, the refcount blocks, the L1 table, an encrypted image's LUKS header,
/// then preallocated L2 tables (QEMU allocates them in that order).
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    reftable_clusters: u64,
    refblocks: u64,
    l1_entries: u64,
    l1_clusters: u64,
    /// Clusters after the L1 table for an encrypted image's LUKS header (or none).
    luks: u64,
    /// Preallocated L2 tables after those, one per L1 entry (or none).
    l2_tables: u64,
    /// Preallocated data clusters in the image itself, after the L2 tables (or none).
    data: u64,
}

/// Where a new image's L2 tables map its clusters, if it has any yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mapping {
    /// No L2 table: an empty L1 table.
    None,
    /// Every cluster to its own offset in the external data file.
    DataFile,
    /// Every cluster to one of the image's own, after the L2 tables (QEMU's
    /// preallocation without a data file).
    InImage,
}

impl Layout {
    /// The layout of `o`, with `luks` clusters for a LUKS header, and an L2 table for every
    /// L1 entry (and, in the image, the data clusters they map) as `mapping` says.
    fn new(o: &Qcow2Create, luks: u64, mapping: Mapping) -> Layout {
        let cs = o.cluster_size;
        let entry_bytes = if o.extended_l2 { 16 } else { 8 };
        let l1_entries = o.size.div_ceil(cs * (cs / entry_bytes));
        let l1_clusters = (l1_entries * 8).div_ceil(cs).max(1);
        let l2_tables = if mapping == Mapping::None {
            0
        } else {
            l1_entries
        };
        let data = if mapping == Mapping::InImage {
            o.size.div_ceil(cs)
        } else {
            0
        };
        let per_block = cs * 8 / o.refcount_bits;
        let (mut rt, mut rb) = (1, 1);
        loop {
            let total = 1 + rt + rb + l1_clusters + luks + l2_tables + data;
            let rb2 = total.div_ceil(per_block);
            let rt2 = (rb2 * 8).div_ceil(cs);
            if (rb2, rt2) == (rb, rt) {
                break;
            }
            (rb, rt) = (rb2, rt2);
        }
        Layout {
            reftable_clusters: rt,
            refblocks: rb,
            l1_entries,
            l1_clusters,
            luks,
            l2_tables,
            data,
        }
    }

    /// Where the L1 table starts, in clusters.
    fn l1_start(&self) -> u64 {
        1 + self.reftable_clusters + self.refblocks
    }

    /// Where the LUKS header starts, in clusters.
    fn luks_start(&self) -> u64 {
        self.l1_start() + self.l1_clusters
    }

    /// Where the preallocated L2 tables start, in clusters.
    fn l2_start(&self) -> u64 {
        self.luks_start() + self.luks
    }

    /// Where the preallocated data clusters start (the metadata's end), in clusters.
    fn data_start(&self) -> u64 {
        self.l2_start() + self.l2_tables
    }

    /// Every cluster the refcounts count.
    fn clusters(&self) -> u64 {
        self.data_start() + self.data
    }
}

/// The header cluster: fields, extensions (backing format, data file name, end) and the
/// backing file name, in QEMU's order (qcow2_update_header); None when they do not fit in
/// one cluster.
fn header(
    o: &Qcow2Create,
    l: &Layout,
    data: Option<&NewDataFile>,
    luks: Option<(u64, u64)>,
) -> Option<Vec<u8>> {
    let cs = o.cluster_size;
    let mut h = vec![0u8; 112];
    let put32 =
        |h: &mut Vec<u8>, at: usize, v: u32| h[at..at + 4].copy_from_slice(&v.to_be_bytes());
    let put64 =
        |h: &mut Vec<u8>, at: usize, v: u64| h[at..at + 8].copy_from_slice(&v.to_be_bytes());
    put32(&mut h, 0, 0x5146_49fb);
    put32(&mut h, 4, if o.v3 { 3 } else { 2 });
    put32(&mut h, 20, cs.trailing_zeros());
    put64(&mut h, 24, o.size);
    put32(&mut h, 36, l.l1_entries as u32);
    put64(&mut h, 40, l.l1_start() * cs);
    put64(&mut h, 48, cs);
    put32(&mut h, 56, l.reftable_clusters as u32);
    h.truncate(72);
    if o.v3 {
        h.resize(112, 0);
        let incompatible =
            u64::from(data.is_some()) << 2 | u64::from(o.zstd) << 3 | u64::from(o.extended_l2) << 4;
        put64(&mut h, 72, incompatible);
        put64(&mut h, 80, u64::from(o.lazy_refcounts));
        put64(&mut h, 88, u64::from(data.is_some_and(|d| d.raw)) << 1);
        put32(&mut h, 96, o.refcount_bits.trailing_zeros());
        put32(&mut h, 100, 112);
        h[104] = u8::from(o.zstd);
    }
    let ext = |h: &mut Vec<u8>, ty: u32, data: &[u8]| {
        h.extend_from_slice(&ty.to_be_bytes());
        h.extend_from_slice(&(data.len() as u32).to_be_bytes());
        h.extend_from_slice(data);
        h.resize(h.len().div_ceil(8) * 8, 0);
    };
    if let Some(fmt) = &o.backing_fmt {
        ext(&mut h, 0xe279_2aca, fmt.as_bytes());
    }
    if let Some(d) = data {
        ext(&mut h, 0x4441_5441, d.name.as_bytes());
    }
    if let Some((offset, length)) = luks {
        put32(&mut h, 32, super::header::crypt::LUKS);
        let place = [offset.to_be_bytes(), length.to_be_bytes()].concat();
        ext(&mut h, super::header::ext::CRYPTO_HEADER, &place);
    }
    // QEMU names the feature bits it knows, in images whose clusters leave room for it.
    if o.v3 && cs > 4096 {
        ext(&mut h, super::header::ext::FEATURE_TABLE, &feature_table());
    }
    // End of the extensions.
    h.extend_from_slice(&[0; 8]);
    if let Some(b) = &o.backing_file {
        let end = h.len();
        put64(&mut h, 8, end as u64);
        put32(&mut h, 16, b.len() as u32);
        h.extend_from_slice(b.as_bytes());
    }
    if h.len() as u64 > cs {
        return None;
    }
    h.resize(cs as usize, 0);
    Some(h)
}

/// The feature name table extension's contents as QEMU's qcow2_update_header writes them:
/// 48 bytes per feature (type, bit, name padded with NULs).
fn feature_table() -> Vec<u8> {
    const FEATURES: [(u8, u8, &str); 8] = [
        (0, 0, "dirty bit"),
        (0, 1, "corrupt bit"),
        (0, 2, "external data file"),
        (0, 3, "compression type"),
        (0, 4, "extended L2 entries"),
        (1, 0, "lazy refcounts"),
        (2, 0, "bitmaps"),
        (2, 1, "raw external data"),
    ];
    let mut t = vec![0u8; FEATURES.len() * 48];
    for (i, (kind, bit, name)) in FEATURES.iter().enumerate() {
        let e = &mut t[i * 48..(i + 1) * 48];
        e[0] = *kind;
        e[1] = *bit;
        e[2..2 + name.len()].copy_from_slice(name.as_bytes());
    }
    t
}

/// Writes a new qcow2 image on `file` (its contents are replaced).
pub async fn create_qcow2(file: &Arc<BlockNode>, o: &Qcow2Create) -> io::Result<()> {
    create_image(file, o, None, None, Prealloc::Off).await
}

/// Writes a new qcow2 image on `file` whose guest data lives in `data` (when given),
/// encrypted with the LUKS volume `crypt` (when given).
pub async fn create_image(
    file: &Arc<BlockNode>,
    o: &Qcow2Create,
    data: Option<&NewDataFile>,
    crypt: Option<&Created>,
    prealloc: Prealloc,
) -> io::Result<()> {
    let cs = o.cluster_size;
    let luks_len = crypt.map_or(0, |c| c.header_size);
    let mapping = match data {
        Some(d) if d.mapped() => Mapping::DataFile,
        Some(_) => Mapping::None,
        None if prealloc != Prealloc::Off => Mapping::InImage,
        None => Mapping::None,
    };
    let l = Layout::new(o, luks_len.div_ceil(cs), mapping);
    if o.backing_file.as_ref().is_some_and(|b| b.len() > 1023) {
        return Err(io::Error::other("Backing file name too long"));
    }
    let luks_at = l.luks_start() * cs;
    let Some(h) = header(o, &l, data, crypt.map(|_| (luks_at, luks_len))) else {
        return Err(io::Error::other(
            "Could not update qcow2 header: No space left on device",
        ));
    };
    let claim = |node: &Arc<BlockNode>, role| {
        let shared = Perm::ALL & Perm::RESIZE.complement();
        node.claim("blockdev-create", role, Perm::WRITE | Perm::RESIZE, shared)
            .map_err(io::Error::other)
    };
    let _claim = claim(file, "file")?;
    let _data_claim = data.map(|d| claim(&d.node, "data-file")).transpose()?;
    clear_metadata_area(file, &l, cs).await?;
    write_at(file, 0, &h).await?;
    write_refcounts(file, o, &l).await?;
    // The LUKS header's area is all zero already: slot 0's key material goes in, then the
    // header.
    if let Some(c) = crypt {
        let (offset, _) = c.luks.material(0);
        write_at(file, luks_at + offset, &c.material).await?;
        write_at(file, luks_at, &c.luks.header.encode()).await?;
    }
    write_mapped_tables(file, o, &l, mapping).await?;
    match data {
        Some(d) => size_data_file(d, o.size).await?,
        // The data clusters, as the mode allocates them (`metadata`: sparse).
        None if mapping == Mapping::InImage => {
            resize_allocated(file, l.clusters() * cs, prealloc).await?
        }
        None => {}
    }
    file.flush().await
}

/// The metadata's area reads as zeroes: grown if the file is smaller (a new file), zeroed
/// where it held something. The rest is left as it is (as QEMU's qcow2_co_create leaves
/// it): storage that cannot change size (an NBD export, a block device) or should not (an
/// RBD image) keeps its size. A new file ends where QEMU's does: after the L1 table's last
/// entry, or after the last cluster of a LUKS header or of preallocated L2 tables.
async fn clear_metadata_area(file: &Arc<BlockNode>, l: &Layout, cs: u64) -> io::Result<()> {
    let total = l.data_start();
    let need = match (l.l1_entries, l.luks + l.l2_tables) {
        (n, 0) if n > 0 => (total - l.l1_clusters) * cs + n * 8,
        _ => total * cs,
    };
    let have = file.size();
    if have < need {
        file.resize(need).await?;
    }
    if have > 0 {
        file.write_zeroes(0, have.min(need), false).await?;
    }
    Ok(())
}

/// Writes `bytes` at `offset` of `node`, padded to whole sectors.
async fn write_at(node: &Arc<BlockNode>, offset: u64, bytes: &[u8]) -> io::Result<()> {
    let mut buf = crate::buf::new_buf(bytes.len().div_ceil(512) * 512);
    buf[..bytes.len()].copy_from_slice(bytes);
    node.write(offset, buf, false).await.0
}

/// The refcount table (one entry per refcount block, which follow it) and the blocks,
/// in which every metadata cluster counts 1.
async fn write_refcounts(file: &Arc<BlockNode>, o: &Qcow2Create, l: &Layout) -> io::Result<()> {
    let cs = o.cluster_size;
    let mut rt = Vec::with_capacity(l.refblocks as usize * 8);
    for i in 0..l.refblocks {
        rt.extend_from_slice(&((1 + l.reftable_clusters + i) * cs).to_be_bytes());
    }
    write_at(file, cs, &rt).await?;
    let per_block = cs * 8 / o.refcount_bits;
    for b in 0..l.refblocks {
        let mut block = vec![0u8; cs as usize];
        let first = b * per_block;
        for c in first..(first + per_block).min(l.clusters()) {
            set_refcount(&mut block, (c - first) as usize, o.refcount_bits, 1);
        }
        write_at(file, (1 + l.reftable_clusters + b) * cs, &block).await?;
    }
    Ok(())
}

/// Preallocated: the L1 table naming the L2 tables after it, and those mapping every
/// guest cluster, COPIED, to its offset in the data file or to the image's data clusters
/// in order (an extended entry's subclusters left unallocated, as QEMU's preallocation
/// leaves them: they read from the backing file, or as zeroes). Else the L1 table stays
/// zero (zeroed before).
async fn write_mapped_tables(
    file: &Arc<BlockNode>,
    o: &Qcow2Create,
    l: &Layout,
    mapping: Mapping,
) -> io::Result<()> {
    const COPIED: u64 = 1 << 63;
    let cs = o.cluster_size;
    let base = match mapping {
        Mapping::None => return Ok(()),
        Mapping::DataFile => 0,
        Mapping::InImage => l.data_start() * cs,
    };
    let first_l2 = l.l2_start();
    let l1: Vec<u8> = (0..l.l1_entries)
        .flat_map(|i| (((first_l2 + i) * cs) | COPIED).to_be_bytes())
        .collect();
    write_at(file, l.l1_start() * cs, &l1).await?;
    let words = if o.extended_l2 { 2 } else { 1 };
    let per_table = cs / (8 * words);
    let clusters = o.size.div_ceil(cs);
    for t in 0..l.l2_tables {
        let mut table = vec![0u8; cs as usize];
        for i in 0..per_table.min(clusters - t * per_table) {
            let host = base + (t * per_table + i) * cs;
            let at = (i * words * 8) as usize;
            table[at..at + 8].copy_from_slice(&(host | COPIED).to_be_bytes());
        }
        write_at(file, (first_l2 + t) * cs, &table).await?;
    }
    Ok(())
}

/// The data file sized for a disk of `size` bytes, as QEMU's truncate of a new image
/// sizes it: to `size` exactly, or, mapped one to one, grown to it if shorter; a grown
/// area allocated as `preallocation` says.
async fn size_data_file(d: &NewDataFile, size: u64) -> io::Result<()> {
    let have = d.node.size();
    if have != size && !(d.mapped() && have > size) {
        resize_allocated(&d.node, size, d.prealloc).await?;
    }
    d.node.flush().await
}

/// Sets entry `i` of a refcount block of `bits`-wide entries (big-endian, MSB first).
fn set_refcount(block: &mut [u8], i: usize, bits: u64, v: u64) {
    match bits {
        64 => block[i * 8..i * 8 + 8].copy_from_slice(&v.to_be_bytes()),
        32 => block[i * 4..i * 4 + 4].copy_from_slice(&(v as u32).to_be_bytes()),
        16 => block[i * 2..i * 2 + 2].copy_from_slice(&(v as u16).to_be_bytes()),
        8 => block[i] = v as u8,
        _ => {
            // Sub-byte widths: entry i sits in byte i*bits/8, at bit (i*bits) % 8 counted
            // from the least significant end, as QEMU's get/set_refcount_ro* read it.
            let bit = i * bits as usize;
            let (byte, shift) = (bit / 8, bit % 8);
            let mask = ((1u16 << bits) - 1) as u8;
            block[byte] = (block[byte] & !(mask << shift)) | ((v as u8 & mask) << shift);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(size: u64, cs: u64, bits: u64) -> Qcow2Create {
        Qcow2Create {
            size,
            v3: true,
            cluster_size: cs,
            refcount_bits: bits,
            lazy_refcounts: false,
            backing_file: None,
            backing_fmt: None,
            zstd: false,
            extended_l2: false,
        }
    }

    #[test]
    fn the_layout_counts_its_own_refcount_blocks() {
        // QEMU's 64 MiB image: header, reftable, refblock, one L1 cluster.
        let l = Layout::new(&opts(64 << 20, 65536, 16), 0, Mapping::None);
        assert_eq!(l.clusters(), 4);
        assert_eq!(l.l1_entries, 1);
        // 512 B clusters, 1-bit refcounts, 1 GiB: L1 of 32768 entries in 512 clusters,
        // which several refcount blocks must cover.
        let l = Layout::new(&opts(1 << 30, 512, 1), 0, Mapping::None);
        assert_eq!(l.l1_clusters, 512);
        assert!(l.refblocks * 512 * 8 >= l.clusters());
        assert!(l.reftable_clusters * 512 / 8 >= l.refblocks);
    }

    #[test]
    fn a_data_file_is_named_and_its_clusters_mapped_one_to_one() {
        let o = opts(1 << 30, 65536, 16);
        // QEMU's layout: header, refcount table and block, L1 table, then two L2 tables.
        let l = Layout::new(&o, 0, Mapping::DataFile);
        assert_eq!((l.l1_start(), l.l2_tables, l.clusters()), (3, 2, 6));
        let d = NewDataFile {
            node: crate::block::drivers::null::test_node("d"),
            name: "/images/disk.raw".into(),
            raw: true,
            prealloc: Prealloc::Metadata,
        };
        let h =
            super::super::header::Header::parse(&header(&o, &l, Some(&d), None).unwrap()).unwrap();
        assert_eq!(h.data_file.as_deref(), Some("/images/disk.raw"));
        assert!(h.has_data_file() && h.data_file_raw());
        assert_eq!(h.l1_table_offset, 3 * 65536);
        // A name that does not fit in the first cluster.
        let small = opts(1 << 20, 512, 16);
        let long = NewDataFile {
            name: "x".repeat(500),
            ..d
        };
        assert!(header(
            &small,
            &Layout::new(&small, 0, Mapping::None),
            Some(&long),
            None
        )
        .is_none());
        // QEMU's rules for the options.
        let given = |node: bool, raw: bool| DataFileOptions {
            node: node.then(|| "d".to_string()),
            raw,
            prealloc: Prealloc::Off,
        };
        assert_eq!(
            given(false, true).check(&o).unwrap_err(),
            "data-file-raw requires data-file"
        );
        let mut b = opts(1 << 20, 65536, 16);
        b.backing_file = Some("base.qcow2".into());
        assert!(given(true, true)
            .check(&b)
            .unwrap_err()
            .contains("data-file-raw cannot"));
        let mut v2 = opts(1 << 20, 65536, 16);
        v2.v3 = false;
        assert!(given(true, false)
            .check(&v2)
            .unwrap_err()
            .contains("compatibility level 1.1"));
    }

    #[test]
    fn qemus_option_rules() {
        let mut o = opts(1000, 65536, 16);
        assert!(o.check().unwrap_err().contains("multiple of 512"));
        o.size = 1 << 20;
        o.cluster_size = 1 << 22;
        assert!(o.check().unwrap_err().contains("Cluster size"));
        o.cluster_size = 65536;
        o.v3 = false;
        o.refcount_bits = 8;
        assert!(o.check().unwrap_err().contains("refcount widths"));
        o.refcount_bits = 16;
        assert!(o.check().is_ok());
        o.extended_l2 = true;
        assert!(o.check().unwrap_err().contains("compatibility level 1.1"));
        o.v3 = true;
        o.cluster_size = 8192;
        assert!(o.check().unwrap_err().contains("at least 16384 bytes"));
        o.cluster_size = 16384;
        assert!(o.check().is_ok());
        // An L2 table of 16 KiB maps 1024 clusters with extended entries: 16 MiB.
        o.size = 64 << 20;
        assert_eq!(Layout::new(&o, 0, Mapping::None).l1_entries, 4);
    }
}
