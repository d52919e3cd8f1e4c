//! The [`Export`] both virtio-blk transports share. The device, its node, its queues and
//! their statistics are the same whether a vhost-user frontend or the kernel (VDUSE) drives
//! it; a [`Transport`] says what differs: the resource it holds, whether a client is
//! connected, how it stops and how the driver hears of a new size. Generic, not `dyn`: each
//! transport gets its own copy, and nothing of this runs per request.

use std::sync::Arc;
use std::task::{Context, Poll};

use stord_aio::Remote;

use super::device::BlkDevice;
use crate::block::node::link::NodeLink;
use crate::export::Export;

/// How the driver reaches the device: a vhost-user socket or a VDUSE device.
pub trait Transport {
    /// The export type (`vhost-user-blk`, `vduse-blk`).
    const KIND: &'static str;
    /// The resource only this export may hold ([`Export::claim`]).
    fn claim(&self) -> String;
    /// A client is connected ([`Export::in_use`]).
    fn in_use(&self) -> bool;
    /// Stops serving at once: no new clients, and the control thread told to end (it stops
    /// the queues). Does not wait; called once.
    fn halt(&mut self);
    /// At drop, after [`halt`](Self::halt): waits for the control threads to end and
    /// releases what they served through.
    fn close(&mut self, dev: &Arc<BlkDevice>);
    /// The node's size changed: tells the driver, as far as the transport can.
    fn resized(&self, dev: &BlkDevice);
    /// Logs what was served, at shutdown (nothing unless the transport does).
    fn log_statistics(&self, _dev: &BlkDevice) {}
}

/// A virtio-blk export: the device and where its queues run, served through `T`.
pub struct VirtioBlkExport<T: Transport> {
    dev: Arc<BlkDevice>,
    /// Where the queues run.
    remotes: Vec<Remote>,
    stopping: bool,
    transport: T,
}

impl<T: Transport> VirtioBlkExport<T> {
    /// The export of `dev`, whose queues run on `remotes`, served through `transport`
    /// (started already).
    pub fn new(dev: Arc<BlkDevice>, remotes: Vec<Remote>, transport: T) -> Self {
        Self {
            dev,
            remotes,
            stopping: false,
            transport,
        }
    }
}

/// The IoThreads a device's queues run on (queue i on `remotes[i % len]`); none named: the
/// current (main) loop.
pub fn queue_remotes(what: &str, mut remotes: Vec<Remote>) -> Result<Vec<Remote>, String> {
    if remotes.is_empty() {
        remotes.push(stord_aio::current_remote().ok_or_else(|| format!("{what}: no event loop"))?);
    }
    Ok(remotes)
}

impl<T: Transport> Export for VirtioBlkExport<T> {
    fn id(&self) -> &str {
        &self.dev.id
    }
    fn kind(&self) -> &'static str {
        T::KIND
    }
    fn writable(&self) -> bool {
        self.dev.writable
    }
    fn link(&self) -> &Arc<NodeLink> {
        &self.dev.link
    }
    fn runs_on(&self, thread: &Remote) -> bool {
        self.remotes
            .iter()
            .any(|r| r.thread_id() == thread.thread_id())
    }
    fn claim(&self) -> Option<String> {
        Some(self.transport.claim())
    }
    fn in_use(&self) -> bool {
        self.transport.in_use()
    }
    fn shutting_down(&self) -> bool {
        self.stopping
    }
    fn describe(&self, out: &mut serde_json::Map<String, serde_json::Value>) {
        out.insert("x-queue-requests".into(), self.dev.queue_requests().into());
    }
    fn begin_stop(&mut self) {
        if !std::mem::replace(&mut self.stopping, true) {
            self.transport.halt();
        }
    }
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.dev.poll_drained(cx)
    }
    fn resized(&self) {
        self.transport.resized(&self.dev);
    }
    fn log_statistics(&self) {
        self.transport.log_statistics(&self.dev);
    }
}

impl<T: Transport> Drop for VirtioBlkExport<T> {
    fn drop(&mut self) {
        self.begin_stop();
        self.transport.close(&self.dev);
    }
}
