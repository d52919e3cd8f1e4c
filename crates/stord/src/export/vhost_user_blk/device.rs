//! What the guest sees of the disk: virtio-blk feature bits, the config space, and the
//! per-export state every queue shares ([`BlkDevice`]).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::BackendReq;

use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;

/// `VHOST_USER_F_PROTOCOL_FEATURES`: the frontend may negotiate protocol features.
pub const VHOST_USER_F_PROTOCOL_FEATURES: u32 = 30;

/// Largest data transfer of one request we accept (a bigger one fails with IOERR rather
/// than making us allocate whatever a guest asks for).
pub const MAX_REQUEST_BYTES: u64 = 32 << 20;

/// Largest discard / write-zeroes range of one segment, in 512-byte sectors.
pub const MAX_DISCARD_SECTORS: u32 = (1 << 30) >> 9;

/// Queue size the frontend may use at most (QEMU's default is 128 for vhost-user-blk).
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// State shared by an export's control thread and all its queues.
/// A connection's guest memory vanished (the frontend truncated a file it shared; see
/// [`crate::guest_fault`]): its queues stop and its connection is closed, once.
pub struct GuestFault {
    /// Raised by the SIGBUS handler.
    pub flag: Arc<std::sync::atomic::AtomicBool>,
    /// The connection, to close (none for a device with no connection: VDUSE).
    sock: Option<std::os::unix::net::UnixStream>,
    reported: std::sync::atomic::AtomicBool,
}

impl GuestFault {
    pub fn new(sock: std::os::unix::net::UnixStream) -> Self {
        Self {
            flag: Arc::default(),
            sock: Some(sock),
            reported: Default::default(),
        }
    }

    /// For memory mapped from a kernel device (VDUSE), raised through `flag`: the queues
    /// stop, and there is no connection to close.
    pub fn with_flag(flag: Arc<AtomicBool>) -> Self {
        Self {
            flag,
            sock: None,
            reported: Default::default(),
        }
    }

    /// Whether the memory vanished; the first time, logs it and closes the connection.
    pub fn check(&self, dev: &str) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.flag.load(SeqCst) {
            return false;
        }
        if !self.reported.swap(true, SeqCst) {
            if self.sock.is_some() {
                tracing::warn!(
                    "vhost-user-blk {dev}: the frontend's memory vanished under the device \
                     (its file was truncated); closing that connection"
                );
            } else {
                tracing::warn!(
                    "vduse-blk {dev}: a driver buffer was not backed by memory (SIGBUS); the \
                     queues stop until the driver resets the device"
                );
            }
            if let Some(sock) = &self.sock {
                let _ = sock.shutdown(std::net::Shutdown::Both);
            }
        }
        true
    }
}

pub struct BlkDevice {
    /// The export type, for log lines (`vhost-user-blk`, `vduse-blk`).
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
    /// The frontend's backend-request channel, if it set one up.
    config_channel: Mutex<Option<ConfigChannel>>,
}

/// A vhost-user header with no body: the request code, the flags (protocol version 1, no
/// reply asked: a frontend answers only when NEED_REPLY is set), the body's size 0.
fn config_change_message() -> [u8; 12] {
    let code: u32 = BackendReq::CONFIG_CHANGE_MSG.into();
    let mut m = [0u8; 12];
    m[0..4].copy_from_slice(&code.to_le_bytes());
    m[4..8].copy_from_slice(&1u32.to_le_bytes());
    m
}

/// The channel on which the device speaks first (`VHOST_USER_PROTOCOL_F_BACKEND_REQ`),
/// used here only to say the config space changed, and the capacity the frontend last
/// heard of.
struct ConfigChannel {
    sock: UnixStream,
    sectors: u64,
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
            config_channel: Mutex::new(None),
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

    fn sectors(&self) -> u64 {
        self.link.current().size() / 512
    }

    /// The frontend connected gave its backend-request channel (`SET_BACKEND_REQ_FD`), or
    /// the connection ended (`None`).
    pub fn set_config_channel(&self, sock: Option<UnixStream>) {
        let channel = sock.and_then(|sock| {
            // Never let a frontend that does not read its channel block the main loop.
            sock.set_nonblocking(true).ok()?;
            Some(ConfigChannel {
                sock,
                sectors: self.sectors(),
            })
        });
        *self
            .config_channel
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = channel;
    }

    /// The node may have changed size. If the capacity differs from what the frontend
    /// last read, tells it the config space changed (`CONFIG_CHANGE_MSG`, as QEMU's
    /// vu_blk_exp_resize does), so it reads the config again and tells its guest. Returns
    /// whether a message went out. Frontends without the channel (libblkio) read the
    /// config space anew when asked, and it follows the node.
    pub fn announce_capacity(&self) -> bool {
        let mut channel = self
            .config_channel
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(c) = channel.as_mut() else {
            return false;
        };
        let sectors = self.sectors();
        if sectors == c.sectors {
            return false;
        }
        match (&c.sock).write(&config_change_message()) {
            Ok(12) => {
                c.sectors = sectors;
                true
            }
            r => {
                tracing::warn!(
                    "vhost-user-blk {}: cannot tell the frontend of the new capacity ({r:?}); \
                     it sees the old size until it reads the config space again",
                    self.id
                );
                *channel = None;
                false
            }
        }
    }

    /// The virtio feature bits we offer.
    pub fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_CONFIG_WCE)
            | (1 << VIRTIO_BLK_F_MQ)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_F_VERSION_1)
            | (1 << VHOST_USER_F_PROTOCOL_FEATURES);
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
