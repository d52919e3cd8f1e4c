//! Creating a qcow2 image (`blockdev-create`, `blockdev-snapshot-sync`): written on an
//! opened node: header (version 3 with compression type, or 2; extended L2 entries on
//! request), one refcount table, the refcount blocks and an empty L1 table for the
//! virtual size, then an encrypted image's LUKS header ([`super::create_crypt`]), every
//! metadata cluster counted once; `qemu-img check` finds it clean.

use std::io;
use std::sync::Arc;

use crate::block::create::{unsupported, CreateDef, CreateEnv, Creation, PREALLOC_MODE};
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
    if kv.take("data-file").is_some() || kv.take_prefixed("data-file").is_some() {
        return Err(unsupported("'data-file'"));
    }
    let encrypt = super::create_crypt::take_options(&mut kv, env)?;
    if kv.take_bool("data-file-raw", false)? {
        return Err(unsupported("'data-file-raw'"));
    }
    match kv.take("preallocation").as_deref() {
        None | Some("off") => {}
        Some(p) => return Err(unsupported(&format!("preallocation={p}"))),
    }
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
    Ok(Box::pin(async move {
        opts.check()?;
        let Some(node) = node else {
            return Err(format!(
                "Cannot find device='{file}' nor node-name='{file}'"
            ));
        };
        let crypt = match encrypt {
            Some(e) => Some(e.make().await?),
            None => None,
        };
        create_qcow2_with(&node, &opts, crypt.as_ref())
            .await
            .map_err(|e| e.to_string())
    }))
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
/// refcount table, the refcount blocks, then the L1 table.
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    reftable_clusters: u64,
    refblocks: u64,
    l1_entries: u64,
    l1_clusters: u64,
    /// Clusters after the L1 table (an encrypted image's LUKS header).
    extra: u64,
}

impl Layout {
    fn new(o: &Qcow2Create, extra: u64) -> Layout {
        let cs = o.cluster_size;
        let entry_bytes = if o.extended_l2 { 16 } else { 8 };
        let l1_entries = o.size.div_ceil(cs * (cs / entry_bytes));
        let l1_clusters = (l1_entries * 8).div_ceil(cs).max(1);
        let per_block = cs * 8 / o.refcount_bits;
        let (mut rt, mut rb) = (1, 1);
        loop {
            let total = 1 + rt + rb + l1_clusters + extra;
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
            extra,
        }
    }

    /// Where the clusters after the L1 table start.
    fn extra_offset(&self, cs: u64) -> u64 {
        (1 + self.reftable_clusters + self.refblocks + self.l1_clusters) * cs
    }

    fn clusters(&self) -> u64 {
        1 + self.reftable_clusters + self.refblocks + self.l1_clusters + self.extra
    }
}

/// The header cluster: fields, extensions (backing format, the LUKS header's place, end)
/// and the backing file name.
fn header(o: &Qcow2Create, l: &Layout, crypt: Option<(u64, u64)>) -> Vec<u8> {
    let cs = o.cluster_size;
    let mut h = vec![0u8; cs as usize];
    let put32 =
        |h: &mut Vec<u8>, at: usize, v: u32| h[at..at + 4].copy_from_slice(&v.to_be_bytes());
    let put64 =
        |h: &mut Vec<u8>, at: usize, v: u64| h[at..at + 8].copy_from_slice(&v.to_be_bytes());
    put32(&mut h, 0, 0x5146_49fb);
    put32(&mut h, 4, if o.v3 { 3 } else { 2 });
    put32(&mut h, 20, cs.trailing_zeros());
    put64(&mut h, 24, o.size);
    put32(&mut h, 36, l.l1_entries as u32);
    put64(&mut h, 40, (1 + l.reftable_clusters + l.refblocks) * cs);
    put64(&mut h, 48, cs);
    put32(&mut h, 56, l.reftable_clusters as u32);
    let mut end = 72;
    if o.v3 {
        let incompatible = u64::from(o.zstd) << 3 | u64::from(o.extended_l2) << 4;
        put64(&mut h, 72, incompatible);
        put64(&mut h, 80, u64::from(o.lazy_refcounts));
        put32(&mut h, 96, o.refcount_bits.trailing_zeros());
        put32(&mut h, 100, 112);
        h[104] = u8::from(o.zstd);
        end = 112;
    }
    if let Some(fmt) = &o.backing_fmt {
        put32(&mut h, end, 0xe279_2aca);
        put32(&mut h, end + 4, fmt.len() as u32);
        h[end + 8..end + 8 + fmt.len()].copy_from_slice(fmt.as_bytes());
        end += 8 + fmt.len().div_ceil(8) * 8;
    }
    if let Some((offset, length)) = crypt {
        put32(&mut h, 32, super::header::crypt::LUKS);
        put32(&mut h, end, super::header::ext::CRYPTO_HEADER);
        put32(&mut h, end + 4, 16);
        put64(&mut h, end + 8, offset);
        put64(&mut h, end + 16, length);
        end += 24;
    }
    // End of the extensions.
    end += 8;
    if let Some(b) = &o.backing_file {
        put64(&mut h, 8, end as u64);
        put32(&mut h, 16, b.len() as u32);
        h[end..end + b.len()].copy_from_slice(b.as_bytes());
    }
    h
}

/// Writes a new qcow2 image on `file` (its contents are replaced).
pub async fn create_qcow2(file: &Arc<BlockNode>, o: &Qcow2Create) -> io::Result<()> {
    create_qcow2_with(file, o, None).await
}

/// [`create_qcow2`], encrypted with the volume `crypt` when given.
async fn create_qcow2_with(
    file: &Arc<BlockNode>,
    o: &Qcow2Create,
    crypt: Option<&Created>,
) -> io::Result<()> {
    let cs = o.cluster_size;
    let luks_len = crypt.map_or(0, |c| c.header_size);
    let l = Layout::new(o, luks_len.div_ceil(cs));
    let luks_at = l.extra_offset(cs);
    let h = header(o, &l, crypt.map(|_| (luks_at, luks_len)));
    if h.len() as u64 > cs || o.backing_file.as_ref().is_some_and(|b| b.len() > 1023) {
        return Err(io::Error::other("Backing file name too long"));
    }
    let _claim = file
        .claim(
            "blockdev-create",
            "file",
            Perm::WRITE | Perm::RESIZE,
            Perm::ALL & Perm::RESIZE.complement(),
        )
        .map_err(io::Error::other)?;
    let total = l.clusters();
    // The metadata's area reads as zeroes: grown if the file is smaller (a new file),
    // zeroed where it held something. The rest is left as it is (as QEMU's qcow2_co_create
    // leaves it): storage that cannot change size (an NBD export, a block device) or
    // should not (an RBD image) keeps its size.
    let (have, need) = (file.size(), total * cs);
    if have < need {
        file.resize(need).await?;
    }
    if have > 0 {
        file.write_zeroes(0, have.min(need), false).await?;
    }
    let write = |offset: u64, bytes: &[u8]| {
        let mut buf = crate::buf::new_buf(bytes.len().div_ceil(512) * 512);
        buf[..bytes.len()].copy_from_slice(bytes);
        let file = file.clone();
        async move { file.write(offset, buf, false).await.0 }
    };
    write(0, &h).await?;
    // Refcount table: one entry per refcount block, which follow it.
    let mut rt = Vec::with_capacity(l.refblocks as usize * 8);
    for i in 0..l.refblocks {
        rt.extend_from_slice(&((1 + l.reftable_clusters + i) * cs).to_be_bytes());
    }
    write(cs, &rt).await?;
    // Refcount blocks: every metadata cluster counts 1.
    let per_block = cs * 8 / o.refcount_bits;
    for b in 0..l.refblocks {
        let mut block = vec![0u8; cs as usize];
        let first = b * per_block;
        for c in first..(first + per_block).min(total) {
            set_refcount(&mut block, (c - first) as usize, o.refcount_bits, 1);
        }
        write((1 + l.reftable_clusters + b) * cs, &block).await?;
    }
    // The L1 table is all zero already (zeroed above), and so is the LUKS header's area:
    // slot 0's key material goes in, then the header.
    if let Some(c) = crypt {
        let (offset, _) = c.luks.material(0);
        write(luks_at + offset, &c.material).await?;
        write(luks_at, &c.luks.header.encode()).await?;
    }
    file.flush().await
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
        let l = Layout::new(&opts(64 << 20, 65536, 16), 0);
        assert_eq!(l.clusters(), 4);
        assert_eq!(l.l1_entries, 1);
        // 512 B clusters, 1-bit refcounts, 1 GiB: L1 of 32768 entries in 512 clusters,
        // which several refcount blocks must cover.
        let l = Layout::new(&opts(1 << 30, 512, 1), 0);
        assert_eq!(l.l1_clusters, 512);
        assert!(l.refblocks * 512 * 8 >= l.clusters());
        assert!(l.reftable_clusters * 512 / 8 >= l.refblocks);
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
        assert_eq!(Layout::new(&o, 0).l1_entries, 4);
    }
}
