//! A node's I/O limits as QEMU keeps them (its `BlockLimits`, `bs->bl`) and reports them
//! in `query-named-block-nodes` (`image.limits`, QEMU 10.2's `BlockLimitsInfo`): how they
//! are found is QEMU's bdrv_refresh_limits. Every node starts from a byte-granular request
//! alignment; a node with children takes their limits merged (bdrv_merge_limits: the
//! larger alignments and optimal sizes, the smaller non-zero maxima), a node without
//! takes the protocol defaults (512-byte buffers, page-sized optimal buffers, IOV_MAX
//! pieces); then the driver puts in what it knows ([`BlockDriver::refresh_limits`]:
//! a file its O_DIRECT alignment and a block device's transfer limits, qcow2 its cluster,
//! an NBD client what the server advertised).
//!
//! [`BlockDriver::refresh_limits`]: super::block_node::BlockDriver::refresh_limits

use serde_json::{json, Map, Value};

/// QEMU's `IOV_MAX`: what a readv/writev takes at most.
pub const IOV_MAX: i64 = 1024;

/// One node's limits; 0 in a maximum or an optional alignment means none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockLimits {
    /// Requests must be aligned to this (offset and length).
    pub request_alignment: u32,
    pub max_discard: u64,
    pub discard_alignment: u32,
    pub max_write_zeroes: u64,
    pub write_zeroes_alignment: u32,
    pub opt_transfer: u32,
    pub max_transfer: u32,
    pub max_hw_transfer: u32,
    pub max_iov: i64,
    pub max_hw_iov: i64,
    pub min_mem_alignment: u64,
    pub opt_mem_alignment: u64,
}

/// The smaller of two values where 0 means "no limit" (QEMU's MIN_NON_ZERO).
fn min_non_zero<T: Ord + Default + Copy>(a: T, b: T) -> T {
    let zero = T::default();
    match (a == zero, b == zero) {
        (true, _) => b,
        (_, true) => a,
        _ => a.min(b),
    }
}

impl BlockLimits {
    /// What every node starts from: requests of any alignment.
    pub fn start() -> Self {
        BlockLimits {
            request_alignment: 1,
            ..Default::default()
        }
    }

    /// The defaults of a node without children (QEMU's for protocol drivers).
    pub fn protocol_defaults(&mut self) {
        self.min_mem_alignment = 512;
        self.opt_mem_alignment = crate::sys::page_size();
        self.max_iov = IOV_MAX;
    }

    /// Takes a child's limits in (QEMU's bdrv_merge_limits; the request alignment and the
    /// discard and zeroing maxima stay the node's own).
    pub fn merge(&mut self, c: &BlockLimits) {
        self.discard_alignment = self.discard_alignment.max(c.discard_alignment);
        self.opt_transfer = self.opt_transfer.max(c.opt_transfer);
        self.max_transfer = min_non_zero(self.max_transfer, c.max_transfer);
        self.max_hw_transfer = min_non_zero(self.max_hw_transfer, c.max_hw_transfer);
        self.opt_mem_alignment = self.opt_mem_alignment.max(c.opt_mem_alignment);
        self.min_mem_alignment = self.min_mem_alignment.max(c.min_mem_alignment);
        self.max_iov = min_non_zero(self.max_iov, c.max_iov);
        self.max_hw_iov = min_non_zero(self.max_hw_iov, c.max_hw_iov);
    }

    /// As QMP reports them (`BlockLimitsInfo`): the optional members only when set.
    pub fn to_qmp(&self) -> Value {
        let mut m = Map::new();
        m.insert("request-alignment".into(), json!(self.request_alignment));
        let optional: [(&str, u64); 7] = [
            ("max-discard", self.max_discard),
            ("discard-alignment", self.discard_alignment.into()),
            ("max-write-zeroes", self.max_write_zeroes),
            ("write-zeroes-alignment", self.write_zeroes_alignment.into()),
            ("opt-transfer", self.opt_transfer.into()),
            ("max-transfer", self.max_transfer.into()),
            ("max-hw-transfer", self.max_hw_transfer.into()),
        ];
        for (k, v) in optional {
            if v != 0 {
                m.insert(k.into(), json!(v));
            }
        }
        m.insert("max-iov".into(), json!(self.max_iov));
        if self.max_hw_iov != 0 {
            m.insert("max-hw-iov".into(), json!(self.max_hw_iov));
        }
        m.insert("min-mem-alignment".into(), json!(self.min_mem_alignment));
        m.insert("opt-mem-alignment".into(), json!(self.opt_mem_alignment));
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_merge_as_qemu_merges_them() {
        let mut file = BlockLimits::start();
        file.protocol_defaults();
        file.min_mem_alignment = 1;
        file.max_hw_transfer = 1 << 20;
        let mut backing = BlockLimits::start();
        backing.protocol_defaults();
        backing.discard_alignment = 65536;
        backing.max_iov = 256;
        let mut fmt = BlockLimits::start();
        fmt.merge(&file);
        fmt.merge(&backing);
        assert_eq!(fmt.request_alignment, 1);
        assert_eq!(fmt.discard_alignment, 65536);
        assert_eq!(fmt.max_hw_transfer, 1 << 20);
        assert_eq!((fmt.max_iov, fmt.min_mem_alignment), (256, 512));
        let q = fmt.to_qmp();
        assert_eq!(q["max-iov"], 256);
        assert!(q.get("max-transfer").is_none() && q.get("max-hw-iov").is_none());
        assert_eq!(q["opt-mem-alignment"], crate::sys::page_size());
    }
}
