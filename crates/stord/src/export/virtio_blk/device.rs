//! What the guest sees of the disk: virtio-blk feature bits, the config space, and the
//! per-export state every queue shares ([`BlkDevice`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;

/// Largest data transfer of one request we accept (a bigger one fails with IOERR rather
/// than making us allocate whatever a guest asks for).
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;

/// Largest discard / write-zeroes range of one segment, in 512-byte sectors.
pub const MAX_DISCARD_SECTORS: u32 = (1 << 30) >> 9;

/// State shared by an export's control thread and all its queues.
pub struct BlkDevice {
    /// The export type, for log lines (`vhost-user-blk` unless the transport sets
    /// `vduse-blk`).
    pub kind: &'static str,
    /// Block-export id.
    pub id: String,
    /// The disk's serial number, as GET_ID returns (the export id unless set).
    pub serial: String,
    /// The node served (a pivot may move it).
    pub link: Arc<NodeLink>,
    pub writable: bool,
    /// Logical block size: 512 or 4096.
    pub logical_block_size: u32,
    pub num_queues: u16,
    /// Write cache enabled (the guest may switch it off through the config space; then
    /// every write is made durable before it completes).
    pub writeback: AtomicBool,
    /// Requests served, per queue.
    pub requests: Vec<AtomicU64>,
    /// Control threads still serving a frontend (counted down as each ends).
    pub serving: std::sync::atomic::AtomicUsize,
    /// Woken when a frontend's connection has ended (its queues stopped).
    pub drain: crate::export::DrainSignal,
}

impl BlkDevice {
    pub fn new(
        id: String,
        node: Arc<BlockNode>,
        writable: bool,
        logical_block_size: u32,
        num_queues: u16,
    ) -> Self {
        Self {
            kind: "vhost-user-blk",
            serial: id.clone(),
            id,
            link: NodeLink::new(node),
            writable,
            logical_block_size,
            num_queues,
            writeback: AtomicBool::new(true),
            requests: (0..num_queues).map(|_| AtomicU64::new(0)).collect(),
            serving: Default::default(),
            drain: Default::default(),
        }
    }

    /// Requests served per queue (query-block-exports' `x-queue-requests`).
    pub fn queue_requests(&self) -> Vec<u64> {
        self.requests
            .iter()
            .map(|r| r.load(Ordering::Relaxed))
            .collect()
    }

    /// Ready once no control thread serves the device any more (`Export::poll_drained`).
    pub fn poll_drained(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.drain
            .poll(cx, || self.serving.load(Ordering::SeqCst) == 0)
    }

    /// The capacity in 512-byte sectors, as the config space gives it.
    pub fn sectors(&self) -> u64 {
        self.link.current().size() / 512
    }

    /// The virtio-blk feature bits the device offers; a transport adds its own
    /// (vhost-user its protocol-features bit) or takes some away (VDUSE).
    pub fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_CONFIG_WCE)
            | (1 << VIRTIO_BLK_F_MQ)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_F_VERSION_1);
        if self.writable {
            f |= (1 << VIRTIO_BLK_F_DISCARD) | (1 << VIRTIO_BLK_F_WRITE_ZEROES);
        } else {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    /// The virtio-blk config space (struct virtio_blk_config, little endian), as much of it
    /// as the frontend asks for; bytes past our fields read as zero.
    pub fn config(&self, offset: u32, size: u32, queue_size: u16) -> Vec<u8> {
        let mut c = [0u8; 96];
        let sectors = self.sectors();
        c[0..8].copy_from_slice(&sectors.to_le_bytes());
        // size_max (8): 0, no limit on a segment's size.
        let seg_max = u32::from(queue_size.max(4)) - 2;
        c[12..16].copy_from_slice(&seg_max.to_le_bytes());
        c[20..24].copy_from_slice(&self.logical_block_size.to_le_bytes());
        // physical_block_exp, alignment_offset: 0; min_io_size in logical blocks: 1.
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        c[32] = u8::from(self.writeback.load(Ordering::Relaxed));
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        let align = self.logical_block_size / 512;
        c[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        c[40..44].copy_from_slice(&1u32.to_le_bytes());
        c[44..48].copy_from_slice(&align.to_le_bytes());
        c[48..52].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
        c[52..56].copy_from_slice(&1u32.to_le_bytes());
        c[56] = 1; // write_zeroes_may_unmap
        let start = (offset as usize).min(c.len());
        let end = (offset as usize + size as usize).min(c.len());
        let mut out = c[start..end].to_vec();
        out.resize(size as usize, 0);
        out
    }

    /// The guest writes the config space: only `wce` (offset 32) is writable.
    pub fn set_config(&self, offset: u32, buf: &[u8]) -> Result<(), String> {
        if offset <= 32 && offset as usize + buf.len() > 32 {
            let wce = buf[32 - offset as usize];
            self.writeback.store(wce != 0, Ordering::Relaxed);
            Ok(())
        } else {
            Err(format!(
                "config write at {offset}+{} touches read-only fields",
                buf.len()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::null::NullDriver;

    fn dev(writable: bool) -> BlkDevice {
        let node = BlockNode::new(
            "n".into(),
            Box::new(NullDriver::new(1 << 30, false)),
            false,
            false,
        );
        BlkDevice::new("e".into(), Arc::new(node), writable, 4096, 2)
    }

    #[test]
    fn config_space_fields() {
        let d = dev(true);
        let c = d.config(0, 60, 128);
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2 << 20);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 126);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(c[32], 1);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        // A window into the middle, and past the end.
        assert_eq!(d.config(34, 2, 128), vec![2, 0]);
        assert_eq!(d.config(200, 4, 128), vec![0; 4]);
    }

    #[test]
    fn wce_is_the_only_writable_field() {
        let d = dev(true);
        d.set_config(32, &[0]).unwrap();
        assert_eq!(d.config(32, 1, 128), vec![0]);
        assert!(d.set_config(0, &[1, 2, 3, 4]).is_err());
    }

    #[test]
    fn read_only_offers_ro_and_no_discard() {
        let f = dev(false).features();
        assert_ne!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(f & (1 << VIRTIO_BLK_F_DISCARD), 0);
        let f = dev(true).features();
        assert_eq!(f & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(f & (1 << VIRTIO_BLK_F_WRITE_ZEROES), 0);
    }
}
