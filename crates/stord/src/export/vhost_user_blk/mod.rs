//! The vhost-user-blk export: a QEMU/KVM guest's virtio-blk disk, served from shared guest
//! memory.
//!
//! This folder is the vhost-user transport of the virtio-blk device
//! ([`virtio_blk`](super::virtio_blk)). The listening socket is watched by the main loop
//! (through an [`Acceptor`](crate::accept::Acceptor)); the connection gets a control thread
//! ([`connection`]) that reads vhost-user messages (blocking, they are rare) through the
//! rust-vmm `vhost` crate's request handler ([`backend`]: memory table, vring setup). The
//! data path never touches that thread: each virtqueue runs on an IoThread of the export's
//! list (the device's [`vring`](super::virtio_blk::vring)): a kick fd handler plus a poll
//! handler peeking at the avail index, requests as tasks, completions batched per loop
//! iteration. Like qsd, one frontend at a time: while one is connected the export stops
//! accepting, so a second waits in the listen backlog (costing the daemon nothing) until
//! the first has gone.

mod backend;
mod config_channel;
mod connection;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;

use stord_aio::Remote;

use super::virtio_blk::device::BlkDevice;
use super::virtio_blk::export::{queue_remotes, Transport, VirtioBlkExport};
use crate::accept::Acceptor;
use crate::block::node::block_node::BlockNode;
use crate::cli::keyval::KeyVal;
use crate::export::{Export, ExportEnv, ExportError};
use connection::Frontends;

/// Options of `--export type=vhost-user-blk`.
pub struct VhostUserBlkOptions {
    pub id: String,
    pub node_name: String,
    pub path: PathBuf,
    pub writable: bool,
    /// `writethrough=on`: the device starts with its write cache off (the guest may turn
    /// it on, as virtio's WCE allows).
    pub writethrough: bool,
    pub num_queues: u16,
    pub logical_block_size: u32,
    pub iothreads: Vec<String>,
}

impl VhostUserBlkOptions {
    /// Parses the options after `type=vhost-user-blk` (the caller took `type`).
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, ExportError> {
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let what = kv.what.clone();
        match kv.take("addr.type").as_deref() {
            Some("unix") => {}
            Some(t) => {
                return Err(format!("{what}: addr.type '{t}' not supported (use unix)").into())
            }
            None => return Err(format!("{what}: Parameter 'addr.type' is missing").into()),
        }
        let path = PathBuf::from(kv.take_required("addr.path")?);
        let writable = kv.take_bool("writable", false)?;
        let writethrough = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let num_queues = kv.take_u64_in("num-queues", false, 1..=64)?.unwrap_or(1) as u16;
        let logical_block_size = match kv.take_u64("logical-block-size", true)? {
            None => 512,
            Some(n @ (512 | 1024 | 2048 | 4096)) => n as u32,
            Some(n) => {
                return Err(format!(
                    "{what}: logical-block-size must be 512, 1024, 2048 or 4096, got {n}"
                )
                .into())
            }
        };
        let iothreads = kv.take_list("iothread");
        Ok(Self {
            id,
            node_name,
            path,
            writable,
            writethrough,
            num_queues,
            logical_block_size,
            iothreads,
        })
    }
}

/// A vhost-user-blk export: the virtio-blk device served through a vhost-user socket.
pub type VhostUserBlkExport = VirtioBlkExport<VhostUserSocket>;

/// The vhost-user transport of an export: the listening socket and the frontends it
/// accepted.
pub struct VhostUserSocket {
    path: PathBuf,
    acceptor: Option<Acceptor>,
    frontends: Arc<Frontends>,
}

impl VhostUserBlkExport {
    /// Binds the socket and starts accepting on the current (main) loop. `remotes` are the
    /// IoThreads that serve the queues (queue i on remotes[i % len]); empty: the main loop.
    pub fn start(
        opts: VhostUserBlkOptions,
        node: Arc<BlockNode>,
        remotes: Vec<Remote>,
    ) -> Result<Self, String> {
        let what = format!("vhost-user-blk export '{}'", opts.id);
        if opts.writable && node.is_read_only() {
            return Err(format!("{what}: node '{}' is read-only", node.name));
        }
        if !node
            .size()
            .is_multiple_of(u64::from(opts.logical_block_size))
        {
            return Err(format!(
                "{what}: size {} is not a multiple of the logical block size {}",
                node.size(),
                opts.logical_block_size
            ));
        }
        let remotes = queue_remotes(&what, remotes)?;
        if opts.path.exists() {
            let _ = std::fs::remove_file(&opts.path);
        }
        let listener = UnixListener::bind(&opts.path)
            .map_err(|e| format!("{what}: cannot listen on {}: {e}", opts.path.display()))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("{what}: {e}"))?;
        let dev = Arc::new(BlkDevice::new(
            opts.id.clone(),
            node,
            opts.writable,
            opts.logical_block_size,
            opts.num_queues,
        ));
        dev.writeback
            .store(!opts.writethrough, std::sync::atomic::Ordering::Relaxed);
        let frontends = Arc::new(Frontends::new(dev.clone(), remotes.clone()));
        let f2 = frontends.clone();
        let acceptor = stord_aio::with_current_context(|ctx| {
            Acceptor::start(ctx, what.clone(), listener.into(), move |conn| {
                connection::accept(conn, &f2)
            })
        })
        .ok_or_else(|| format!("{what}: no event loop"))?
        .map_err(|e| format!("{what}: {e}"))?;
        let socket = VhostUserSocket {
            path: opts.path,
            acceptor: Some(acceptor),
            frontends,
        };
        Ok(VirtioBlkExport::new(dev, remotes, socket))
    }
}

/// `--export type=vhost-user-blk` / `block-export-add`.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let opts = VhostUserBlkOptions::from_opts(&mut kv)?;
    let what = kv.what.clone();
    kv.finish()?;
    let node = env.node(&what, &opts.node_name)?;
    env.check_claim(&what, &opts.path.display().to_string())?;
    let remotes = env.remotes(&what, &opts.iothreads)?;
    Ok(Box::new(VhostUserBlkExport::start(opts, node, remotes)?))
}

impl Transport for VhostUserSocket {
    const KIND: &'static str = "vhost-user-blk";

    fn claim(&self) -> String {
        self.path.display().to_string()
    }

    fn in_use(&self) -> bool {
        self.frontends.connected()
    }

    /// Stops listening and disconnects the frontend; its queues stop on their own.
    fn halt(&mut self) {
        self.acceptor.take();
        let _ = std::fs::remove_file(&self.path);
        self.frontends.disconnect();
    }

    /// Waits for the frontend's queues to drain. Called on the main loop, which it keeps
    /// running meanwhile (a queue may live there).
    fn close(&mut self, dev: &Arc<BlkDevice>) {
        // Each control thread counts itself out of `serving` and wakes the drain as it
        // ends; then joining it does not block.
        let dev = dev.clone();
        crate::export::wait_drained(None, move |cx| {
            dev.drain.poll(cx, || {
                dev.serving.load(std::sync::atomic::Ordering::SeqCst) == 0
            })
        });
        self.frontends.join();
    }

    fn resized(&self, dev: &BlkDevice) {
        self.frontends.channel.announce_capacity(dev);
    }

    fn log_statistics(&self, dev: &BlkDevice) {
        tracing::info!(
            "vhost-user-blk export {}: requests per queue {:?}",
            dev.id,
            dev.queue_requests()
        );
    }
}
