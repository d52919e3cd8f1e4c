//! Per-node request accounting with QEMU's fields (BlockAcctStats, what
//! `query-blockstats` reports): per kind of request the operations, bytes, failures,
//! requests refused as invalid and the time spent; the highest offset written; when the
//! node was last used. QEMU keeps these in the BlockBackends of guest devices, which a
//! storage daemon has none of (qsd reports zeroes per node); stord counts every request
//! that reaches a node, whoever sends it (an export, a job, a parent node).
//!
//! Counters are relaxed atomics on the node, written by whichever thread serves the
//! request: no lock on the I/O path, and a node served by one IoThread keeps its cache
//! lines there. A query sums nothing and locks nothing; it reads.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde_json::{json, Map, Value};
use stord_aio::sys::now_ns;
use stord_aio::Histogram;

/// A kind of request, as QEMU accounts it (write-zeroes count as writes, discards as
/// unmaps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Unmap,
}

/// One kind's counters.
#[derive(Debug, Default)]
struct Counters {
    ops: AtomicU64,
    bytes: AtomicU64,
    failed: AtomicU64,
    invalid: AtomicU64,
    total_ns: AtomicU64,
}

/// A node's counters.
#[derive(Debug, Default)]
pub struct NodeStats {
    by_op: [Counters; 4],
    wr_highest_offset: AtomicU64,
    /// When the last request ended (0: never), for `idle_time_ns`.
    last_access_ns: AtomicU64,
    /// Request latency, power-of-two buckets (stord's own).
    pub latency_ns: Histogram,
}

impl NodeStats {
    fn of(&self, op: Op) -> &Counters {
        &self.by_op[op as usize]
    }

    /// A request refused before it started: out of range (invalid) or not allowed
    /// (failed).
    pub fn refused(&self, op: Op, e: &std::io::Error) {
        let c = self.of(op);
        if e.kind() == std::io::ErrorKind::InvalidInput {
            c.invalid.fetch_add(1, Relaxed);
        } else {
            c.failed.fetch_add(1, Relaxed);
        }
    }

    /// A request that started at `start_ns` has ended: `bytes` moved if `ok` (QEMU's
    /// block_account_one_io, failed requests' time counted too).
    pub fn done(&self, op: Op, start_ns: u64, bytes: u64, ok: bool) {
        let c = self.of(op);
        let now = now_ns();
        if ok {
            c.ops.fetch_add(1, Relaxed);
            c.bytes.fetch_add(bytes, Relaxed);
        } else {
            c.failed.fetch_add(1, Relaxed);
        }
        let took = now.saturating_sub(start_ns);
        c.total_ns.fetch_add(took, Relaxed);
        self.latency_ns.record(took);
        self.last_access_ns.store(now, Relaxed);
    }

    /// A write ending at `end` succeeded.
    pub fn wrote_up_to(&self, end: u64) {
        self.wr_highest_offset.fetch_max(end, Relaxed);
    }

    /// QEMU's BlockDeviceStats.
    pub fn to_qmp(&self) -> Value {
        let mut m = Map::new();
        let names = [
            (Op::Read, "rd"),
            (Op::Write, "wr"),
            (Op::Flush, "flush"),
            (Op::Unmap, "unmap"),
        ];
        for (op, n) in names {
            let c = self.of(op);
            if op != Op::Flush {
                m.insert(format!("{n}_bytes"), c.bytes.load(Relaxed).into());
                m.insert(format!("{n}_merged"), 0.into());
            }
            m.insert(format!("{n}_operations"), c.ops.load(Relaxed).into());
            m.insert(
                format!("{n}_total_time_ns"),
                c.total_ns.load(Relaxed).into(),
            );
            m.insert(
                format!("failed_{n}_operations"),
                c.failed.load(Relaxed).into(),
            );
            m.insert(
                format!("invalid_{n}_operations"),
                c.invalid.load(Relaxed).into(),
            );
        }
        for (k, v) in [
            ("zone_append_bytes", 0),
            ("zone_append_operations", 0),
            ("zone_append_total_time_ns", 0),
            ("zone_append_merged", 0),
            ("failed_zone_append_operations", 0),
            ("invalid_zone_append_operations", 0),
        ] {
            m.insert(k.into(), v.into());
        }
        m.insert(
            "wr_highest_offset".into(),
            self.wr_highest_offset.load(Relaxed).into(),
        );
        let last = self.last_access_ns.load(Relaxed);
        if last != 0 {
            m.insert("idle_time_ns".into(), now_ns().saturating_sub(last).into());
        }
        m.insert("account_invalid".into(), true.into());
        m.insert("account_failed".into(), true.into());
        m.insert("timed_stats".into(), json!([]));
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_land_in_qemus_fields() {
        let s = NodeStats::default();
        let t = now_ns();
        s.done(Op::Read, t, 4096, true);
        s.done(Op::Write, t, 512, true);
        s.done(Op::Write, t, 512, false);
        s.refused(
            Op::Write,
            &std::io::Error::from(std::io::ErrorKind::InvalidInput),
        );
        s.refused(Op::Unmap, &std::io::Error::from_raw_os_error(libc::EPERM));
        s.wrote_up_to(8192);
        s.wrote_up_to(4096);
        let v = s.to_qmp();
        assert_eq!(v["rd_operations"], 1);
        assert_eq!(v["rd_bytes"], 4096);
        assert_eq!(v["wr_operations"], 1);
        assert_eq!(v["wr_bytes"], 512);
        assert_eq!(v["failed_wr_operations"], 1);
        assert_eq!(v["invalid_wr_operations"], 1);
        assert_eq!(v["failed_unmap_operations"], 1);
        assert_eq!(v["wr_highest_offset"], 8192);
        assert!(v.get("idle_time_ns").is_some());
        assert!(v.get("flush_bytes").is_none());
        assert!(NodeStats::default().to_qmp().get("idle_time_ns").is_none());
    }
}
