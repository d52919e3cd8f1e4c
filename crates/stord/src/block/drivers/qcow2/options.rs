//! The `--blockdev driver=qcow2` options beyond the children, with QEMU's rules for the
//! table caches' sizes.

use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;

/// QEMU's cap on the default L2 cache (32 MiB).
const DEFAULT_L2_CACHE_MAX: u64 = 32 << 20;

/// `--blockdev driver=qcow2` options beyond the children.
#[derive(Debug, Clone, Default)]
pub struct Qcow2Options {
    /// `l2-cache-size` in bytes.
    pub l2_cache: Option<u64>,
    /// `refcount-cache-size` in bytes.
    pub refcount_cache: Option<u64>,
    /// `cache-size`: both caches together.
    pub cache: Option<u64>,
    /// `discard=unmap`: guest discards free clusters (the default, `ignore`, drops them).
    pub discard: bool,
}

impl Qcow2Options {
    /// Takes the options from a `--blockdev` / `blockdev-add`.
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, GraphError> {
        let o = Self {
            l2_cache: kv.take_u64("l2-cache-size", true)?,
            refcount_cache: kv.take_u64("refcount-cache-size", true)?,
            cache: kv.take_u64("cache-size", true)?,
            discard: matches!(
                kv.take_choice("discard", &["ignore", "off", "unmap", "on"])?
                    .as_deref(),
                Some("unmap" | "on")
            ),
        };
        // Accepted as QEMU does; stord keeps refcounts exact, so lazy ones change nothing.
        let _ = kv.take_bool("lazy-refcounts", false)?;
        let _ = kv.take_bool("pass-discard-request", true)?;
        // QEMU: an unsigned int of seconds.
        let _ = kv.take_u64_in("cache-clean-interval", false, 0..=u64::from(u32::MAX))?;
        // QEMU's rules for the three cache sizes (read_cache_sizes), and its texts.
        if let Some(total) = o.cache {
            let bad = |m: &str| Err(GraphError::Invalid(m.into()));
            match (o.l2_cache, o.refcount_cache) {
                (Some(_), Some(_)) => {
                    return bad("cache-size, l2-cache-size and refcount-cache-size may not be set at the same time")
                }
                (Some(l2), None) if l2 > total => return bad("l2-cache-size may not exceed cache-size"),
                (None, Some(rc)) if rc > total => {
                    return bad("refcount-cache-size may not exceed cache-size")
                }
                _ => {}
            }
        }
        Ok(o)
    }

    /// Tables in the L2 and refcount caches, for an image of `size` bytes whose L2 entries
    /// take `entry_bytes` (8, or 16 when extended).
    pub(super) fn cache_tables(
        &self,
        size: u64,
        cluster_size: u64,
        entry_bytes: u64,
    ) -> (usize, usize) {
        let whole_disk = size.div_ceil(cluster_size * (cluster_size / entry_bytes)) * cluster_size;
        let (l2, rc) = match (self.l2_cache, self.refcount_cache, self.cache) {
            (Some(l2), Some(rc), _) => (l2.min(whole_disk), rc),
            (Some(l2), None, Some(total)) => (l2.min(whole_disk), total - l2),
            (Some(l2), None, None) => (l2.min(whole_disk), (l2 / 4).max(4 * cluster_size)),
            (None, rc, Some(total)) => {
                let rc = rc.unwrap_or((total / 4).max(4 * cluster_size).min(total / 2));
                (total - rc, rc)
            }
            (None, rc, None) => {
                let l2 = whole_disk.min(DEFAULT_L2_CACHE_MAX);
                (l2, rc.unwrap_or((l2 / 4).max(4 * cluster_size)))
            }
        };
        (
            (l2 / cluster_size).max(2) as usize,
            (rc / cluster_size).max(2) as usize,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QEMU's rules for the cache sizes; before, refcount-cache-size over cache-size
    /// underflowed the subtraction of one from the other.
    #[test]
    fn cache_sizes_follow_qemus_rules() {
        let opts = |s: &str| {
            let mut kv = KeyVal::parse("--blockdev", s, None).unwrap();
            Qcow2Options::from_opts(&mut kv).map_err(|e| e.to_string())
        };
        assert_eq!(
            opts("cache-size=1M,refcount-cache-size=2M").unwrap_err(),
            "refcount-cache-size may not exceed cache-size"
        );
        assert_eq!(
            opts("cache-size=1M,l2-cache-size=2M").unwrap_err(),
            "l2-cache-size may not exceed cache-size"
        );
        assert!(opts("cache-size=1M,l2-cache-size=1M,refcount-cache-size=1M").is_err());
        // l2 beyond the whole disk is cut to it: a 1 GiB image with 64 KiB clusters needs
        // 128 KiB of L2 tables (2 tables).
        let o = opts("l2-cache-size=1T").unwrap();
        assert_eq!(o.cache_tables(1 << 30, 65536, 8).0, 2);
        // Extended entries: twice the tables for the same disk.
        assert_eq!(o.cache_tables(1 << 30, 65536, 16).0, 4);
        let o = opts("cache-size=4M,l2-cache-size=1M").unwrap();
        assert_eq!(o.cache_tables(1 << 40, 65536, 8), (16, 48));
    }
}
