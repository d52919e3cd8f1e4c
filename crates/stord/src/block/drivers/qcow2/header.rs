//! The qcow2 header and its extensions: parsed from bytes and checked, with no I/O, so the
//! checks can be driven by tests (and fuzzers) on their own.
//!
//! Everything an image says about itself is untrusted: sizes and offsets are checked
//! against the limits QEMU applies before any of them is used to size an allocation.

use thiserror::Error;

use super::bytes::{be32, be64};

/// "QFI\xfb".
pub const MAGIC: u32 = 0x5146_49fb;

/// Whether `first`, a file's first bytes, starts like a qcow2 image (for probing a backing
/// file whose format the image does not name).
pub fn has_magic(first: &[u8]) -> bool {
    first.starts_with(&MAGIC.to_be_bytes())
}
/// Length of a version 2 header (and the part version 3 shares with it).
const V2_HEADER_LEN: usize = 72;
/// Shortest version 3 header.
const V3_HEADER_LEN: usize = 104;
/// The largest L1 table QEMU opens (32 MiB).
pub(super) const MAX_L1_BYTES: u64 = 32 << 20;
/// The largest refcount table QEMU opens (8 MiB).
pub(super) const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// The longest LUKS header stord accepts in an encrypted image (QEMU makes them of about
/// 2 MiB).
const MAX_CRYPTO_HEADER: u64 = 64 << 20;
/// The longest backing file name QEMU accepts.
const MAX_BACKING_NAME: u32 = 1023;

/// Incompatible feature bits.
pub mod incompat {
    /// Refcounts may be stale (lazy refcounts were on when the image was last open).
    pub const DIRTY: u64 = 1 << 0;
    /// Metadata is known to be corrupt.
    pub const CORRUPT: u64 = 1 << 1;
    /// Guest data lives in an external data file.
    pub const DATA_FILE: u64 = 1 << 2;
    /// `compression_type` is not zlib.
    pub const COMPRESSION: u64 = 1 << 3;
    /// Extended L2 entries (subclusters).
    pub const EXTL2: u64 = 1 << 4;
    /// Every bit this driver knows.
    pub const KNOWN: u64 = DIRTY | CORRUPT | DATA_FILE | COMPRESSION | EXTL2;
}

/// Header extension types.
pub(super) mod ext {
    pub const END: u32 = 0;
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    pub const DATA_FILE: u32 = 0x4441_5441;
    pub const BITMAPS: u32 = 0x2385_2875;
    /// Where the LUKS header of an encrypted image lies (offset and length, 16 bytes).
    pub const CRYPTO_HEADER: u32 = 0x0537_be77;
    /// The names of the feature bits (48 bytes each: type, bit, name).
    pub const FEATURE_TABLE: u32 = 0x6803_f857;
}

/// The header's `crypt_method`.
pub mod crypt {
    pub const NONE: u32 = 0;
    /// QEMU's legacy AES-CBC, refused.
    pub const AES: u32 = 1;
    /// LUKS, its header in clusters the crypto header extension points at.
    pub const LUKS: u32 = 2;
}

/// Autoclear feature bits.
pub mod autoclear {
    /// The bitmaps extension is consistent with the image (a program that does not keep
    /// the bitmaps clears it on a read-write open, which invalidates them).
    pub const BITMAPS: u64 = 1;
    /// The external data file reads as the guest disk by itself, a raw image (its
    /// clusters mapped one to one).
    pub const DATA_FILE_RAW: u64 = 1 << 1;
}

/// Byte offsets of fields written back by the driver.
pub mod field {
    /// `size` (u64).
    pub const SIZE: u64 = 24;
    /// `l1_size` (u32), followed by `l1_table_offset` (u64).
    pub const L1: u64 = 36;
    /// `incompatible_features` (u64, version 3).
    pub const INCOMPATIBLE: u64 = 72;
    /// `refcount_table_offset` (u64), followed by `refcount_table_clusters` (u32).
    pub const REFCOUNT_TABLE: u64 = 48;
    /// `autoclear_features` (u64, version 3).
    pub const AUTOCLEAR: u64 = 88;
}

/// The image's first cluster with its extension area rewritten: every extension kept as
/// it was (unknown ones too, in their order) except the bitmaps extension, which becomes
/// `bitmaps` (or goes), and the backing file name moved behind the end marker with its
/// offset field updated; `autoclear` replaces the autoclear bits. QEMU rewrites the area
/// the same way (qcow2_update_header); the header proper is left as it is.
pub fn with_bitmaps_ext(
    cluster0: &[u8],
    bitmaps: Option<&[u8]>,
    autoclear: u64,
) -> Result<Vec<u8>, HeaderError> {
    rewrite_area(
        cluster0,
        AreaChange {
            bitmaps: Some(bitmaps),
            backing: None,
            autoclear: Some(autoclear),
        },
    )
}

/// The image's first cluster naming `backing` (file name and format) as its backing file,
/// or none: the name and the backing format extension change, everything else is kept
/// (QEMU's qcow2_change_backing_file).
pub fn with_backing(
    cluster0: &[u8],
    backing: Option<(&str, Option<&str>)>,
) -> Result<Vec<u8>, HeaderError> {
    if let Some((name, _)) = backing {
        if name.len() > MAX_BACKING_NAME as usize {
            return Err(invalid("backing file name too long"));
        }
    }
    rewrite_area(
        cluster0,
        AreaChange {
            bitmaps: None,
            backing: Some(backing),
            autoclear: None,
        },
    )
}

/// What a rewrite of the extension area changes (None: keep as it is).
struct AreaChange<'a> {
    bitmaps: Option<Option<&'a [u8]>>,
    backing: Option<Option<(&'a str, Option<&'a str>)>>,
    autoclear: Option<u64>,
}

fn rewrite_area(cluster0: &[u8], change: AreaChange<'_>) -> Result<Vec<u8>, HeaderError> {
    let h = Header::parse(cluster0)?;
    let cs = (h.cluster_size() as usize).min(cluster0.len());
    let mut out = cluster0[..h.header_length as usize].to_vec();
    let push = |out: &mut Vec<u8>, ty: u32, data: &[u8]| {
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(8) * 8, 0);
    };
    let mut at = h.header_length as usize;
    let mut old_end = at;
    while at + 8 <= cs {
        let ty = be32(cluster0, at);
        let len = be32(cluster0, at + 4) as usize;
        at += 8;
        if ty == ext::END {
            break;
        }
        // parse() checked every extension lies within the cluster.
        let replaced = (ty == ext::BITMAPS && change.bitmaps.is_some())
            || (ty == ext::BACKING_FORMAT && change.backing.is_some());
        if !replaced {
            push(&mut out, ty, &cluster0[at..at + len]);
        }
        at += len.div_ceil(8) * 8;
    }
    old_end = old_end.max(at);
    if let Some(Some((_, Some(fmt)))) = change.backing {
        // QEMU writes the format first among the extensions it adds.
        push(&mut out, ext::BACKING_FORMAT, fmt.as_bytes());
    }
    if let Some(Some(b)) = change.bitmaps {
        push(&mut out, ext::BITMAPS, b);
    }
    out.extend_from_slice(&[0; 8]);
    let name_off = be64(cluster0, 8) as usize;
    let name_len = be32(cluster0, 16) as usize;
    if name_off != 0 {
        old_end = old_end.max(name_off + name_len);
    }
    let name = match change.backing {
        Some(b) => b.map(|(n, _)| n.as_bytes()),
        None => (name_off != 0).then(|| &cluster0[name_off..name_off + name_len]),
    };
    match name {
        Some(name) => {
            let new_off = out.len() as u64;
            out.extend_from_slice(name);
            out[8..16].copy_from_slice(&new_off.to_be_bytes());
            out[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        }
        None => {
            out[8..20].fill(0);
        }
    }
    if out.len() > cs {
        return Err(invalid(
            "the header extensions do not fit in the first cluster",
        ));
    }
    if let (true, Some(autoclear)) = (h.version >= 3, change.autoclear) {
        out[88..96].copy_from_slice(&autoclear.to_be_bytes());
    }
    // What the old area held past the new end reads as zeroes.
    if out.len() < old_end {
        out.resize(old_end, 0);
    }
    Ok(out)
}

/// How compressed clusters are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (QEMU's default).
    Zlib,
    /// Zstandard.
    Zstd,
}

/// Why an image cannot be opened.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HeaderError {
    /// Not a qcow2 image.
    #[error("Image is not in qcow2 format")]
    NotQcow2,
    /// The header is shorter than its version needs.
    #[error("qcow2 header truncated ({0} bytes)")]
    Truncated(usize),
    /// Version 1 or something newer than 3.
    #[error("Unsupported qcow2 version {0}")]
    Version(u32),
    /// A field is out of range.
    #[error("qcow2: {0}")]
    Invalid(String),
    /// A feature the driver does not implement (it is never served wrongly).
    #[error("Unsupported qcow2 feature(s): {0}")]
    Unsupported(String),
}

/// A parsed, checked header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// Entries in the L1 table.
    pub l1_size: u32,
    /// Where the L1 table is.
    pub l1_table_offset: u64,
    /// Where the refcount table is.
    pub refcount_table_offset: u64,
    /// Its length in clusters.
    pub refcount_table_clusters: u32,
    /// Internal snapshots.
    pub nb_snapshots: u32,
    /// Where the snapshot table starts.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (version 2: none).
    pub incompatible: u64,
    /// Compatible feature bits.
    pub compatible: u64,
    /// Autoclear feature bits.
    pub autoclear: u64,
    /// log2 of the refcount width in bits (0..=6).
    pub refcount_order: u32,
    /// Length of the header proper; extensions follow it.
    pub header_length: u32,
    /// Compression of compressed clusters.
    pub compression: Compression,
    /// The backing file's name, as stored.
    pub backing_file: Option<String>,
    /// The backing file's format (`backing_fmt`), if the image names it.
    pub backing_format: Option<String>,
    /// The bitmaps extension's bytes as stored, if the image has one (checked by
    /// [`super::bitmaps`] when the autoclear bit says it is valid).
    pub bitmaps_ext: Option<Vec<u8>>,
    /// The external data file's name, as stored (its extension, up to a NUL byte).
    pub data_file: Option<String>,
    /// `crypt_method` ([`crypt`]).
    pub crypt_method: u32,
    /// Where the LUKS header of an encrypted image lies: offset (cluster-aligned) and
    /// length in bytes.
    pub crypto_header: Option<(u64, u64)>,
}

fn invalid(s: impl Into<String>) -> HeaderError {
    HeaderError::Invalid(s.into())
}

impl Header {
    /// The bytes to read to parse the header with its extensions: the first cluster (as
    /// far as the cluster size can be told from `first`, the file's first bytes).
    pub fn bytes_needed(first: &[u8]) -> Result<usize, HeaderError> {
        if first.len() < V2_HEADER_LEN {
            return Err(HeaderError::Truncated(first.len()));
        }
        let bits = be32(first, 20);
        if !(9..=21).contains(&bits) {
            return Err(invalid(format!(
                "Cluster size must be a power of two between 512 and 2048k (cluster_bits {bits})"
            )));
        }
        Ok(1 << bits)
    }

    /// Parses and checks a header from the image's first cluster (`buf` may be shorter
    /// when the file is).
    pub fn parse(buf: &[u8]) -> Result<Header, HeaderError> {
        let mut h = Self::parse_v2_fields(buf)?;
        let cluster_size = h.cluster_size();
        if h.version == 3 {
            h.parse_v3_fields(buf, cluster_size)?;
        }
        h.check_features(buf)?;
        h.check_tables(cluster_size)?;
        h.parse_extensions(buf, cluster_size)?;
        h.parse_backing_name(buf, cluster_size)?;
        if h.crypt_method == crypt::LUKS && h.crypto_header.is_none() {
            return Err(invalid(format!(
                "Missing CRYPTO header for crypt method {}",
                h.crypt_method
            )));
        }
        Ok(h)
    }

    /// The fields both versions have (the magic, version and cluster size checked, and
    /// encryption other than LUKS refused); version 3's take their version 2 values.
    fn parse_v2_fields(buf: &[u8]) -> Result<Header, HeaderError> {
        if buf.len() < 4 || be32(buf, 0) != MAGIC {
            return Err(HeaderError::NotQcow2);
        }
        if buf.len() < V2_HEADER_LEN {
            return Err(HeaderError::Truncated(buf.len()));
        }
        let version = be32(buf, 4);
        if version != 2 && version != 3 {
            return Err(HeaderError::Version(version));
        }
        let cluster_bits = be32(buf, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(invalid(format!(
                "Cluster size must be a power of two between 512 and 2048k (cluster_bits {cluster_bits})"
            )));
        }
        let h = Header {
            version,
            cluster_bits,
            size: be64(buf, 24),
            l1_size: be32(buf, 36),
            l1_table_offset: be64(buf, 40),
            refcount_table_offset: be64(buf, 48),
            refcount_table_clusters: be32(buf, 56),
            nb_snapshots: be32(buf, 60),
            snapshots_offset: be64(buf, 64),
            incompatible: 0,
            compatible: 0,
            autoclear: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LEN as u32,
            compression: Compression::Zlib,
            backing_file: None,
            backing_format: None,
            bitmaps_ext: None,
            data_file: None,
            crypt_method: be32(buf, 32),
            crypto_header: None,
        };
        match h.crypt_method {
            crypt::NONE | crypt::LUKS => Ok(h),
            // QEMU's words where it refuses these images (its system emulators).
            crypt::AES => Err(invalid(
                "Use of AES-CBC encrypted qcow2 images is no longer supported in system \
                 emulators",
            )),
            m => Err(invalid(format!("Unsupported encryption method {m}"))),
        }
    }

    /// Version 3's fields: feature bits, refcount width, header length, compression type.
    fn parse_v3_fields(&mut self, buf: &[u8], cluster_size: u64) -> Result<(), HeaderError> {
        if buf.len() < V3_HEADER_LEN {
            return Err(HeaderError::Truncated(buf.len()));
        }
        self.incompatible = be64(buf, 72);
        self.compatible = be64(buf, 80);
        self.autoclear = be64(buf, 88);
        self.refcount_order = be32(buf, 96);
        self.header_length = be32(buf, 100);
        let hl = self.header_length as u64;
        if hl < V3_HEADER_LEN as u64 || hl > cluster_size || hl > buf.len() as u64 {
            return Err(invalid(format!("Invalid header length {hl}")));
        }
        if hl > 104 {
            self.compression = match buf[104] {
                0 => Compression::Zlib,
                1 => Compression::Zstd,
                t => return Err(invalid(format!("Unknown compression type {t}"))),
            };
        }
        Ok(())
    }

    /// Refuses a refcount width past 64 bits, the incompatible features stord does not
    /// know, subclusters smaller than 512 bytes, and a compression type its feature bit
    /// contradicts.
    fn check_features(&self, buf: &[u8]) -> Result<(), HeaderError> {
        if self.refcount_order > 6 {
            return Err(invalid(
                "Reference count entry width too large; may not exceed 64 bits",
            ));
        }
        let unknown = self.incompatible & !incompat::KNOWN;
        if unknown != 0 {
            return Err(HeaderError::Unsupported(self.feature_names(buf, unknown)));
        }
        // QEMU's rule: subclusters of at least 512 bytes (clusters of 16 KiB or more).
        if self.extended_l2() && self.cluster_bits < 9 + 5 {
            return Err(invalid(format!(
                "Unsupported subcluster size: {}",
                self.cluster_size() >> 5
            )));
        }
        if (self.incompatible & incompat::COMPRESSION != 0)
            != (self.compression != Compression::Zlib)
        {
            return Err(invalid(
                "the compression type bit and the compression_type field disagree",
            ));
        }
        Ok(())
    }

    fn check_tables(&self, cluster_size: u64) -> Result<(), HeaderError> {
        let mask = cluster_size - 1;
        if self.l1_table_offset & mask != 0 || self.l1_table_offset == 0 && self.l1_size > 0 {
            return Err(invalid("L1 table offset invalid"));
        }
        if self.l1_size as u64 * 8 > MAX_L1_BYTES {
            return Err(invalid("Active L1 table too large"));
        }
        if self.refcount_table_offset & mask != 0 || self.refcount_table_offset == 0 {
            return Err(invalid("Refcount table offset invalid"));
        }
        if self.refcount_table_clusters as u64 * cluster_size > MAX_REFTABLE_BYTES {
            return Err(invalid("Reference count table too large"));
        }
        // Every guest cluster must have an L1 entry.
        let l2_coverage = cluster_size * (cluster_size / self.l2_entry_bytes());
        let needed = self.size.div_ceil(l2_coverage);
        if needed > self.l1_size as u64 {
            return Err(invalid(format!(
                "L1 table too small for the image size ({} entries, {needed} needed)",
                self.l1_size
            )));
        }
        if self.size > (1u64 << 62) {
            return Err(invalid("Image size too large"));
        }
        Ok(())
    }

    /// QEMU's words for incompatible feature bits `mask` (report_unsupported_feature):
    /// the names the image's own feature name table gives them, then the rest in hex.
    fn feature_names(&self, buf: &[u8], mut mask: u64) -> String {
        let mut names = Vec::new();
        let end = (self.cluster_size() as usize).min(buf.len());
        let mut at = self.header_length as usize;
        while at + 8 <= end {
            let (ty, len) = (be32(buf, at), be32(buf, at + 4) as usize);
            at += 8;
            if ty == ext::END || len > end - at {
                break;
            }
            if ty == ext::FEATURE_TABLE {
                for f in buf[at..at + len].chunks_exact(48) {
                    let (kind, bit) = (f[0], u32::from(f[1]));
                    if kind == 0 && bit < 64 && mask & (1 << bit) != 0 {
                        let name = f[2..].split(|&b| b == 0).next().unwrap_or_default();
                        names.push(String::from_utf8_lossy(name).into_owned());
                        mask &= !(1 << bit);
                    }
                }
            }
            at += len.div_ceil(8) * 8;
        }
        if mask != 0 {
            names.push(format!("Unknown incompatible feature: {mask:x}"));
        }
        names.join(", ")
    }

    fn parse_extensions(&mut self, buf: &[u8], cluster_size: u64) -> Result<(), HeaderError> {
        let end = (cluster_size as usize).min(buf.len());
        let mut at = self.header_length as usize;
        while at + 8 <= end {
            let ty = be32(buf, at);
            let len = be32(buf, at + 4) as usize;
            at += 8;
            if ty == ext::END {
                break;
            }
            if len > end - at {
                return Err(invalid(format!(
                    "header extension {ty:#x} runs past the first cluster"
                )));
            }
            let data = &buf[at..at + len];
            match ty {
                ext::BACKING_FORMAT => {
                    let s = std::str::from_utf8(data)
                        .map_err(|_| invalid("backing format name is not UTF-8"))?;
                    self.backing_format = Some(s.trim_end_matches('\0').to_string());
                }
                ext::DATA_FILE => {
                    // QEMU reads it as a C string: it ends at the first NUL byte.
                    let name = data.split(|&b| b == 0).next().unwrap_or_default();
                    let s = std::str::from_utf8(name)
                        .map_err(|_| invalid("data file name is not UTF-8"))?;
                    self.data_file = Some(s.to_string());
                }
                ext::BITMAPS => self.bitmaps_ext = Some(data.to_vec()),
                ext::CRYPTO_HEADER => self.crypto_header = Some(self.crypto_ext(data)?),
                // Feature names, unknown: nothing to act on.
                _ => {}
            }
            at += len.div_ceil(8) * 8;
        }
        Ok(())
    }

    /// The crypto header extension's offset and length, checked as QEMU checks them.
    fn crypto_ext(&self, data: &[u8]) -> Result<(u64, u64), HeaderError> {
        if self.crypt_method != crypt::LUKS {
            return Err(invalid(
                "CRYPTO header extension only expected with LUKS encryption method",
            ));
        }
        if data.len() != 16 {
            return Err(invalid(format!(
                "CRYPTO header extension size {}, but expected size 16",
                data.len()
            )));
        }
        let (offset, length) = (be64(data, 0), be64(data, 8));
        if !offset.is_multiple_of(self.cluster_size()) {
            return Err(invalid(format!(
                "Encryption header offset '{offset}' is not a multiple of cluster size '{}'",
                self.cluster_size()
            )));
        }
        // A LUKS1 header with its eight slots' key material takes about 2 MiB at most;
        // one said to take far more is refused before anything walks its clusters.
        if length > MAX_CRYPTO_HEADER || offset.checked_add(length).is_none() {
            return Err(invalid(format!(
                "CRYPTO header extension length {length} is too large"
            )));
        }
        Ok((offset, length))
    }

    fn parse_backing_name(&mut self, buf: &[u8], cluster_size: u64) -> Result<(), HeaderError> {
        let off = be64(buf, 8);
        let len = be32(buf, 16);
        if off == 0 {
            return Ok(());
        }
        if len > MAX_BACKING_NAME
            || off
                .checked_add(len as u64)
                .is_none_or(|e| e > cluster_size.min(buf.len() as u64))
        {
            return Err(invalid(
                "Backing file name too long or outside the first cluster",
            ));
        }
        let name = &buf[off as usize..off as usize + len as usize];
        let name =
            std::str::from_utf8(name).map_err(|_| invalid("backing file name is not UTF-8"))?;
        if !name.is_empty() {
            self.backing_file = Some(name.to_string());
        }
        Ok(())
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether L2 entries are extended (subclusters: see [`super::subcluster`]).
    pub fn extended_l2(&self) -> bool {
        self.incompatible & incompat::EXTL2 != 0
    }

    /// Whether guest data lives in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.incompatible & incompat::DATA_FILE != 0
    }

    /// Whether the external data file is a raw image of the guest disk by itself.
    pub fn data_file_raw(&self) -> bool {
        self.autoclear & autoclear::DATA_FILE_RAW != 0
    }

    /// Bytes per L2 entry: 16 when extended, else 8.
    pub fn l2_entry_bytes(&self) -> u64 {
        8 << u64::from(self.extended_l2())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal version 3 header (64 KiB clusters, 1 GiB) with room for extensions.
    fn v3() -> Vec<u8> {
        let mut b = vec![0u8; 65536];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[20..24].copy_from_slice(&16u32.to_be_bytes());
        b[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        b[36..40].copy_from_slice(&2u32.to_be_bytes());
        b[40..48].copy_from_slice(&(3u64 << 16).to_be_bytes());
        b[48..56].copy_from_slice(&(1u64 << 16).to_be_bytes());
        b[56..60].copy_from_slice(&1u32.to_be_bytes());
        b[96..100].copy_from_slice(&4u32.to_be_bytes());
        b[100..104].copy_from_slice(&112u32.to_be_bytes());
        b
    }

    #[test]
    fn a_plain_v3_header_parses() {
        let h = Header::parse(&v3()).unwrap();
        assert_eq!((h.version, h.cluster_size(), h.size), (3, 65536, 1 << 30));
        assert_eq!((h.l1_size, h.refcount_order), (2, 4));
        assert_eq!(h.backing_file, None);
    }

    #[test]
    fn extended_l2_entries_need_16k_clusters_and_halve_the_l2_reach() {
        let ext = |bits: u32, l1: u32| {
            let mut b = v3();
            b[72..80].copy_from_slice(&incompat::EXTL2.to_be_bytes());
            b[20..24].copy_from_slice(&bits.to_be_bytes());
            b[36..40].copy_from_slice(&l1.to_be_bytes());
            b[40..48].copy_from_slice(&(3u64 << bits).to_be_bytes());
            b[48..56].copy_from_slice(&(1u64 << bits).to_be_bytes());
            Header::parse(&b)
        };
        assert_eq!(
            ext(13, 1024).unwrap_err().to_string(),
            "qcow2: Unsupported subcluster size: 256"
        );
        // 16 KiB clusters: an L2 table maps 1024 clusters (16 MiB), so 1 GiB needs 64.
        assert_eq!(
            ext(14, 63).unwrap_err().to_string(),
            "qcow2: L1 table too small for the image size (63 entries, 64 needed)"
        );
        let h = ext(14, 64).unwrap();
        assert_eq!((h.extended_l2(), h.l2_entry_bytes()), (true, 16));
    }

    #[test]
    fn backing_name_and_format_are_read() {
        let mut b = v3();
        // Backing format extension, then the end marker, then the name.
        b[112..116].copy_from_slice(&ext::BACKING_FORMAT.to_be_bytes());
        b[116..120].copy_from_slice(&5u32.to_be_bytes());
        b[120..125].copy_from_slice(b"qcow2");
        b[8..16].copy_from_slice(&200u64.to_be_bytes());
        b[16..20].copy_from_slice(&8u32.to_be_bytes());
        b[200..208].copy_from_slice(b"base.img");
        let h = Header::parse(&b).unwrap();
        assert_eq!(h.backing_file.as_deref(), Some("base.img"));
        assert_eq!(h.backing_format.as_deref(), Some("qcow2"));
    }

    #[test]
    fn the_backing_file_changes_and_goes_keeping_other_extensions() {
        let mut b = v3();
        b[112..116].copy_from_slice(&ext::BACKING_FORMAT.to_be_bytes());
        b[116..120].copy_from_slice(&5u32.to_be_bytes());
        b[120..125].copy_from_slice(b"qcow2");
        // An extension stord does not know, kept as it is.
        b[128..132].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        b[132..136].copy_from_slice(&3u32.to_be_bytes());
        b[136..139].copy_from_slice(b"abc");
        b[8..16].copy_from_slice(&300u64.to_be_bytes());
        b[16..20].copy_from_slice(&8u32.to_be_bytes());
        b[300..308].copy_from_slice(b"base.img");
        let changed = with_backing(&b, Some(("/images/mid.qcow2", Some("raw")))).unwrap();
        let h = Header::parse(&changed).unwrap();
        assert_eq!(h.backing_file.as_deref(), Some("/images/mid.qcow2"));
        assert_eq!(h.backing_format.as_deref(), Some("raw"));
        let unknown = 0x1234_5678u32.to_be_bytes();
        assert!(changed.windows(4).any(|w| w == unknown));
        let gone = with_backing(&changed, None).unwrap();
        let h = Header::parse(&gone).unwrap();
        assert_eq!((h.backing_file, h.backing_format), (None, None));
        assert_eq!(be64(&gone, 8), 0);
        assert!(gone.windows(4).any(|w| w == unknown));
        // The old name's bytes read as zeroes.
        assert!(!gone.windows(8).any(|w| w == b"base.img"));
    }

    #[test]
    fn an_external_data_file_is_named_and_kept_on_rewrites() {
        let mut b = v3();
        b[72..80].copy_from_slice(&incompat::DATA_FILE.to_be_bytes());
        b[88..96].copy_from_slice(&autoclear::DATA_FILE_RAW.to_be_bytes());
        // The name, NUL-padded to its 8-byte boundary as QEMU stores it.
        b[112..116].copy_from_slice(&ext::DATA_FILE.to_be_bytes());
        b[116..120].copy_from_slice(&8u32.to_be_bytes());
        b[120..128].copy_from_slice(b"disk.raw");
        let h = Header::parse(&b).unwrap();
        assert_eq!(h.data_file.as_deref(), Some("disk.raw"));
        assert!(h.has_data_file() && h.data_file_raw());
        // A backing file set and the bitmaps written keep the name and the bits.
        let changed = with_backing(&b, Some(("base.qcow2", Some("qcow2")))).unwrap();
        let changed = with_bitmaps_ext(&changed, None, h.autoclear).unwrap();
        let h2 = Header::parse(&changed).unwrap();
        assert_eq!(h2.data_file.as_deref(), Some("disk.raw"));
        assert!(h2.has_data_file() && h2.data_file_raw());
        assert_eq!(h2.backing_file.as_deref(), Some("base.qcow2"));
    }

    #[test]
    fn the_crypto_header_extension_is_checked_as_qemu_checks_it() {
        let with = |method: u32, len: u32, offset: u64| {
            let mut b = v3();
            b[32..36].copy_from_slice(&method.to_be_bytes());
            b[112..116].copy_from_slice(&ext::CRYPTO_HEADER.to_be_bytes());
            b[116..120].copy_from_slice(&len.to_be_bytes());
            b[120..128].copy_from_slice(&offset.to_be_bytes());
            b[128..136].copy_from_slice(&2068480u64.to_be_bytes());
            Header::parse(&b).map_err(|e| e.to_string())
        };
        let h = with(crypt::LUKS, 16, 4 << 16).unwrap();
        assert_eq!(h.crypto_header, Some((4 << 16, 2068480)));
        assert_eq!(
            with(crypt::NONE, 16, 4 << 16).unwrap_err(),
            "qcow2: CRYPTO header extension only expected with LUKS encryption method"
        );
        assert_eq!(
            with(crypt::LUKS, 8, 4 << 16).unwrap_err(),
            "qcow2: CRYPTO header extension size 8, but expected size 16"
        );
        let mut b = v3();
        b[32..36].copy_from_slice(&crypt::LUKS.to_be_bytes());
        b[112..116].copy_from_slice(&ext::CRYPTO_HEADER.to_be_bytes());
        b[116..120].copy_from_slice(&16u32.to_be_bytes());
        b[120..128].copy_from_slice(&(4u64 << 16).to_be_bytes());
        b[128..136].copy_from_slice(&(1u64 << 62).to_be_bytes());
        assert!(Header::parse(&b)
            .unwrap_err()
            .to_string()
            .contains("too large"));
        assert_eq!(
            with(crypt::LUKS, 16, 4096).unwrap_err(),
            "qcow2: Encryption header offset '4096' is not a multiple of cluster size '65536'"
        );
    }

    #[test]
    fn bad_headers_are_refused_with_a_reason() {
        let set32 = |at: usize, v: u32| {
            let mut b = v3();
            b[at..at + 4].copy_from_slice(&v.to_be_bytes());
            Header::parse(&b).unwrap_err()
        };
        let set64 = |at: usize, v: u64| {
            let mut b = v3();
            b[at..at + 8].copy_from_slice(&v.to_be_bytes());
            Header::parse(&b).unwrap_err()
        };
        assert_eq!(set32(0, 0), HeaderError::NotQcow2);
        assert_eq!(set32(4, 1), HeaderError::Version(1));
        assert!(matches!(set32(20, 8), HeaderError::Invalid(_)));
        assert!(matches!(set32(20, 22), HeaderError::Invalid(_)));
        assert_eq!(
            set32(32, 1).to_string(),
            "qcow2: Use of AES-CBC encrypted qcow2 images is no longer supported in system emulators"
        );
        assert_eq!(
            set32(32, 2).to_string(),
            "qcow2: Missing CRYPTO header for crypt method 2"
        );
        assert_eq!(
            set32(32, 3).to_string(),
            "qcow2: Unsupported encryption method 3"
        );
        // The L1 table cannot map the whole disk.
        assert!(matches!(set32(36, 1), HeaderError::Invalid(_)));
        assert!(matches!(set32(36, u32::MAX), HeaderError::Invalid(_)));
        assert!(matches!(set64(40, 4096), HeaderError::Invalid(_)));
        assert!(matches!(set64(48, 0), HeaderError::Invalid(_)));
        assert!(matches!(set32(56, 1 << 20), HeaderError::Invalid(_)));
        assert!(matches!(set32(96, 7), HeaderError::Invalid(_)));
        assert!(matches!(set32(100, 200_000), HeaderError::Invalid(_)));
        // Extended L2 entries halve an L2 table's reach: 2 L1 entries no longer map 1 GiB.
        assert!(matches!(
            set64(72, incompat::EXTL2),
            HeaderError::Invalid(_)
        ));
        assert!(matches!(set64(72, 1 << 40), HeaderError::Unsupported(_)));
        assert!(matches!(
            set64(72, incompat::COMPRESSION),
            HeaderError::Invalid(_)
        ));
        // A backing name outside the first cluster.
        let mut b = v3();
        b[8..16].copy_from_slice(&65530u64.to_be_bytes());
        b[16..20].copy_from_slice(&100u32.to_be_bytes());
        assert!(matches!(Header::parse(&b), Err(HeaderError::Invalid(_))));
        // An extension longer than the cluster.
        let mut b = v3();
        b[112..116].copy_from_slice(&ext::BACKING_FORMAT.to_be_bytes());
        b[116..120].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(Header::parse(&b), Err(HeaderError::Invalid(_))));
        assert!(matches!(
            Header::parse(&v3()[..80]),
            Err(HeaderError::Truncated(80))
        ));
    }
}
