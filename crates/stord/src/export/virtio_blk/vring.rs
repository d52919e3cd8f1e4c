//! One virtqueue served by an IoThread: a kick fd handler, a poll handler that peeks at the
//! avail index, requests as tasks, each completion published in the used ring as it
//! happens, and the call eventfd written once per loop iteration (a bottom half).
//!
//! While the loop busy-polls, guest notifications for the queue stay suppressed (with
//! EVENT_IDX we simply do not advance avail_event; without it, VRING_USED_F_NO_NOTIFY is
//! set). When polling ends they are re-enabled, and the loop's final peek catches requests
//! that raced with the switch.
//!
//! The data a queue's requests buffer is bounded: once [`MAX_QUEUE_BYTES`] are held by
//! running requests, further requests wait (their chains parked, no buffer allocated)
//! until earlier ones complete, so a guest that fills a large ring with 32 MiB requests
//! costs at most that, not ring size times 32 MiB.
//!
//! A [`Vring`] lives on its IoThread only; the control thread reaches it through
//! [`VringHandle`] (a Remote plus an id into this thread's registry).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use stord_aio::sys::now_ns;
use stord_aio::{
    Bh, Counter, FdHandlerId, Histogram, Interest, PollHandler, PollHandlerId, Remote,
};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};

use super::chain::{walk_chain, Chain, WalkError};
use super::device::BlkDevice;
use super::guest_fault::GuestFault;
use super::inflight::{InflightQueue, InflightRegion};
use super::request;

/// Data bytes one queue's running requests may hold (a request larger than what is left
/// still runs when it is the only one).
pub const MAX_QUEUE_BYTES: usize = 64 << 20;

/// How a queue interrupts its driver: a call eventfd (vhost-user) or an ioctl (VDUSE).
pub trait Interrupt: Send + Sync {
    fn raise(&self);
}

/// Memory that is mapped piece by piece as the driver hands it out (VDUSE's IOVA space)
/// instead of all up front (a vhost-user memory table).
pub trait LazyMemory: Send + Sync {
    /// Memory that also maps `addr`, or None if nothing does.
    fn map(&self, addr: u64) -> Option<Arc<GuestMemoryMmap>>;
    /// Whether the device may write `[addr, addr + len)` (mapped ranges may be read-only).
    fn writable(&self, addr: u64, len: u64) -> bool;
}

/// Everything needed to start a queue on its IoThread (all Send).
pub struct VringStart {
    pub index: u16,
    pub queue: Queue,
    pub mem: Arc<GuestMemoryMmap>,
    /// Maps what `mem` lacks, when a chain points there.
    pub lazy: Option<Arc<dyn LazyMemory>>,
    pub kick: File,
    pub call: Option<Arc<dyn Interrupt>>,
    pub dev: Arc<BlkDevice>,
    pub inflight: Option<Arc<InflightRegion>>,
    pub enabled: bool,
    /// The connection's guest memory vanished: stop and close.
    pub fault: Arc<GuestFault>,
}

/// The control thread's handle on a running queue.
pub struct VringHandle {
    pub remote: Remote,
    id: u64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static RUNNING: RefCell<HashMap<u64, Rc<Vring>>> = RefCell::new(HashMap::new());
}

fn with_vring<T>(id: u64, f: impl FnOnce(&Rc<Vring>) -> T) -> Option<T> {
    let v = RUNNING.with(|r| r.borrow().get(&id).cloned());
    v.map(|v| f(&v))
}

/// Runs `f` on `remote`'s thread and waits for it (directly if that is this thread).
fn run_on<T: Send + 'static>(remote: &Remote, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    if remote.is_current() {
        Some(f())
    } else {
        remote.run(f)
    }
}

impl VringHandle {
    /// Starts the queue on `remote`'s thread.
    pub fn start(remote: Remote, start: VringStart) -> Result<VringHandle, String> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        run_on(&remote, move || Vring::start(id, start))
            .ok_or_else(|| "the queue's IoThread has stopped".to_string())??;
        Ok(VringHandle { remote, id })
    }

    /// Stops taking requests, waits (up to `limit`) for those in flight, publishes their
    /// completions and returns the next avail index (GET_VRING_BASE's answer).
    pub fn stop(self, limit: Duration) -> u16 {
        let id = self.id;
        // The queue tells us when its last request completes: one round trip to stop it,
        // then a wait on the channel (no polling of its count).
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pending = run_on(&self.remote, move || {
            with_vring(id, |v| {
                v.halt();
                let n = v.in_flight.get();
                if n > 0 {
                    *v.drained.borrow_mut() = Some(tx);
                }
                n
            })
        })
        .flatten()
        .unwrap_or(0);
        // On the queue's own thread nothing could complete while we waited.
        if pending > 0 && !self.remote.is_current() && rx.recv_timeout(limit).is_err() {
            let n = run_on(&self.remote, move || with_vring(id, |v| v.in_flight.get()))
                .flatten()
                .unwrap_or(0);
            tracing::warn!("vhost-user-blk: queue stopped with {n} requests still in flight");
        }
        run_on(&self.remote, move || {
            RUNNING.with(|r| r.borrow_mut().remove(&id)).map(|v| {
                v.notify();
                v.queue.borrow().next_avail()
            })
        })
        .flatten()
        .unwrap_or(0)
    }

    /// Replaces the call eventfd.
    pub fn set_call(&self, call: Option<Arc<dyn Interrupt>>) {
        let id = self.id;
        run_on(&self.remote, move || {
            with_vring(id, |v| *v.call.borrow_mut() = call)
        });
    }

    /// The next avail index the queue will take (VDUSE's GET_VQ_STATE).
    pub fn next_avail(&self) -> Option<u16> {
        let id = self.id;
        run_on(&self.remote, move || {
            with_vring(id, |v| v.queue.borrow().next_avail())
        })
        .flatten()
    }

    /// Replaces guest memory (a new memory table while running).
    pub fn set_mem(&self, mem: Arc<GuestMemoryMmap>) {
        let id = self.id;
        run_on(&self.remote, move || {
            with_vring(id, |v| *v.mem.borrow_mut() = mem)
        });
    }

    /// SET_VRING_ENABLE while running.
    pub fn set_enabled(&self, on: bool) {
        let id = self.id;
        run_on(&self.remote, move || {
            with_vring(id, |v| {
                v.enabled.set(on);
                if on {
                    v.process();
                }
            })
        });
    }
}

/// What a queue counts, in its IoThread's statistics (`query-iothreads` x-stats, shared
/// by the queues of one IoThread): the notification traffic per request that decides
/// whether the loop and the driver keep each other awake or put each other to sleep.
struct VringStats {
    /// Requests taken from the ring.
    requests: Arc<Counter>,
    /// Kick eventfd events (the driver notified us).
    kicks: Arc<Counter>,
    /// Call eventfd writes (we interrupted the driver).
    calls: Arc<Counter>,
    /// Completions published that needed no call (the driver did not ask: EVENT_IDX).
    calls_skipped: Arc<Counter>,
    /// Times notifications were re-enabled (the driver may kick again).
    rearms: Arc<Counter>,
    /// Requests taken per pass over the ring.
    pops_per_pass: Arc<Histogram>,
    /// From the first completion published after the last call to the next call, ns.
    used_to_call_ns: Arc<Histogram>,
    /// From taking a request off the ring to publishing its completion, ns (one request
    /// in 16, to keep clock reads off most of the path).
    service_ns: Arc<Histogram>,
}

impl VringStats {
    fn new() -> Self {
        stord_aio::with_current_context(|ctx| VringStats {
            requests: ctx.counter("virtqueue.requests"),
            kicks: ctx.counter("virtqueue.kicks"),
            calls: ctx.counter("virtqueue.calls"),
            calls_skipped: ctx.counter("virtqueue.calls-skipped"),
            rearms: ctx.counter("virtqueue.notify-rearms"),
            pops_per_pass: ctx.histogram("virtqueue.pops-per-pass"),
            used_to_call_ns: ctx.histogram("virtqueue.used-to-call-ns"),
            service_ns: ctx.histogram("virtqueue.service-ns"),
        })
        .expect("a queue runs on a loop")
    }
}

/// A queue on its IoThread.
pub struct Vring {
    index: u16,
    queue: RefCell<Queue>,
    mem: RefCell<Arc<GuestMemoryMmap>>,
    lazy: Option<Arc<dyn LazyMemory>>,
    kick: File,
    call: RefCell<Option<Arc<dyn Interrupt>>>,
    dev: Arc<BlkDevice>,
    inflight: Option<InflightQueue>,
    /// Completions were published since the guest was last signalled (`flush_bh` signals).
    notify_pending: Cell<bool>,
    /// When the first of those was published (ns).
    first_unsignalled_ns: Cell<u64>,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated.
    event_idx: bool,
    stats: VringStats,
    flush_bh: RefCell<Option<Bh>>,
    /// Requests taken from the ring and not completed (running or waiting for budget).
    in_flight: Cell<usize>,
    /// Requests running, and the data bytes they hold.
    running: Cell<(usize, usize)>,
    /// Requests taken from the ring that wait for budget, in ring order.
    waiting: RefCell<VecDeque<(u16, Result<Chain, String>)>>,
    /// [`Vring::run_waiting`] is starting waiting requests: one that completes at once and
    /// asks again leaves the rest to it (no recursion through requests that need no I/O).
    starting_waiting: Cell<bool>,
    /// The heads one pass over the ring took (kept to reuse its allocation).
    heads: RefCell<Vec<u16>>,
    /// The loop is busy-polling us (notifications suppressed).
    polling: Cell<bool>,
    enabled: Cell<bool>,
    halted: Cell<bool>,
    /// Told when the last request in flight completes after a stop.
    drained: RefCell<Option<std::sync::mpsc::SyncSender<()>>>,
    /// The connection's guest memory vanished (checked at each pass and completion).
    fault: Arc<GuestFault>,
    /// The driver broke the ring (e.g. an avail index beyond the ring): stop serving it.
    broken: Cell<bool>,
    handlers: Cell<Option<(FdHandlerId, PollHandlerId)>>,
}

/// The poll handler registered for a queue (a thin wrapper so the loop holds no cycle).
struct VringPoll(std::rc::Weak<Vring>);

impl PollHandler for VringPoll {
    fn name(&self) -> &str {
        "virtqueue"
    }
    fn poll(&self) -> bool {
        self.0.upgrade().is_some_and(|v| v.has_work())
    }
    fn ready(&self) {
        if let Some(v) = self.0.upgrade() {
            v.process();
        }
    }
    fn poll_begin(&self) {
        if let Some(v) = self.0.upgrade() {
            v.polling.set(true);
            let mem = v.mem.borrow().clone();
            let _ = v.queue.borrow_mut().disable_notification(&*mem);
        }
    }
    fn poll_end(&self) {
        if let Some(v) = self.0.upgrade() {
            v.polling.set(false);
            let mem = v.mem.borrow().clone();
            // The loop peeks once more after this, so a request that raced is not lost.
            let _ = v.queue.borrow_mut().enable_notification(&*mem);
            v.stats.rearms.add(1);
        }
    }
}

impl Vring {
    /// Builds the queue on this (its IoThread's) loop, takes up what an earlier daemon left
    /// in flight, watches the kick eventfd and the avail index, and registers it as `id`.
    fn start(id: u64, s: VringStart) -> Result<(), String> {
        let ctx_ok = stord_aio::with_current_context(|_| ()).is_some();
        if !ctx_ok {
            return Err("no event loop on this thread".into());
        }
        let v = Self::new(s);
        v.install_flush_bh();
        v.resubmit_in_flight();
        v.watch_kick_and_poll()?;
        RUNNING.with(|r| r.borrow_mut().insert(id, v.clone()));
        // Requests queued before the kick fd arrived.
        v.process();
        Ok(())
    }

    fn new(s: VringStart) -> Rc<Self> {
        let inflight = s.inflight.and_then(|r| InflightQueue::new(r, s.index));
        let event_idx = s.queue.event_idx_enabled();
        Rc::new(Vring {
            index: s.index,
            queue: RefCell::new(s.queue),
            mem: RefCell::new(s.mem),
            lazy: s.lazy,
            kick: s.kick,
            call: RefCell::new(s.call),
            dev: s.dev,
            inflight,
            notify_pending: Cell::new(false),
            first_unsignalled_ns: Cell::new(0),
            event_idx,
            stats: VringStats::new(),
            flush_bh: RefCell::new(None),
            in_flight: Cell::new(0),
            running: Cell::new((0, 0)),
            waiting: RefCell::default(),
            starting_waiting: Cell::new(false),
            heads: RefCell::default(),
            polling: Cell::new(false),
            enabled: Cell::new(s.enabled),
            halted: Cell::new(false),
            drained: RefCell::new(None),
            broken: Cell::new(false),
            handlers: Cell::new(None),
            fault: s.fault,
        })
    }

    /// The bottom half that ends a loop pass which published completions: one signal to
    /// the driver ([`notify`](Self::notify)), then what it queued meanwhile.
    fn install_flush_bh(self: &Rc<Self>) {
        let weak = Rc::downgrade(self);
        let bh = stord_aio::with_current_context(|ctx| {
            ctx.new_bh(move || {
                if let Some(v) = weak.upgrade() {
                    v.notify();
                    // What the driver queued while we completed (QEMU's do/while around
                    // its handler): take it now instead of waiting for a kick or a poll.
                    if v.has_work() {
                        v.process();
                    }
                }
            })
        })
        .expect("context");
        *self.flush_bh.borrow_mut() = Some(bh);
    }

    /// Runs again the requests a previous daemon took and never completed (the in-flight
    /// log says which).
    fn resubmit_in_flight(self: &Rc<Self>) {
        let resubmit = match &self.inflight {
            Some(q) => {
                let mem = self.mem.borrow().clone();
                let used = self
                    .queue
                    .borrow()
                    .used_idx(&*mem, Ordering::Acquire)
                    .map(|w| w.0)
                    .unwrap_or(0);
                q.start(used)
            }
            None => Vec::new(),
        };
        if !resubmit.is_empty() {
            // A restarted daemon picking up where the last one was: expected, not a fault.
            tracing::info!(
                "{} {}: queue {} resubmits {} requests left in flight",
                self.dev.kind,
                self.dev.id,
                self.index,
                resubmit.len()
            );
        }
        for head in resubmit {
            self.submit(head);
        }
    }

    /// Serves the driver's kicks (the kick eventfd's handler) and the loop's busy polling
    /// (a poll handler peeking at the avail index).
    fn watch_kick_and_poll(self: &Rc<Self>) -> Result<(), String> {
        let weak = Rc::downgrade(self);
        let kick_fd = self.kick.as_raw_fd();
        let ids = stord_aio::with_current_context(|ctx| {
            let fd = ctx.set_fd_handler(kick_fd, Interest::READABLE, move |_| {
                if let Some(v) = weak.upgrade() {
                    let mut b = [0u8; 8];
                    let _ = (&v.kick).read(&mut b);
                    v.stats.kicks.add(1);
                    v.process();
                }
            })?;
            let poll = ctx.add_poll_handler(Rc::new(VringPoll(Rc::downgrade(self))));
            Ok::<_, std::io::Error>((fd, poll))
        })
        .expect("context")
        .map_err(|e| format!("cannot watch the kick eventfd: {e}"))?;
        self.handlers.set(Some(ids));
        Ok(())
    }

    fn has_work(&self) -> bool {
        if self.halted.get() || self.broken.get() || !self.enabled.get() {
            return false;
        }
        let mem = self.mem.borrow();
        let q = self.queue.borrow();
        q.avail_idx(&**mem, Ordering::Acquire)
            .is_ok_and(|i| i.0 != q.next_avail())
    }

    /// Stops serving: no more kicks, polls or new requests.
    fn halt(&self) {
        self.halted.set(true);
        if let Some((fd, poll)) = self.handlers.take() {
            stord_aio::with_current_context(|ctx| {
                ctx.remove_fd_handler(fd);
                ctx.remove_poll_handler(poll);
            });
        }
    }

    /// Takes every available request and starts it as a task.
    fn process(self: &Rc<Self>) {
        if self.halted.get() || self.broken.get() || !self.enabled.get() {
            return;
        }
        if self.fault.check(&self.dev.id) {
            self.broken.set(true);
            return;
        }
        let mem = self.mem.borrow().clone();
        let mut heads = std::mem::take(&mut *self.heads.borrow_mut());
        loop {
            heads.clear();
            {
                let mut q = self.queue.borrow_mut();
                if !self.polling.get() {
                    let _ = q.disable_notification(&*mem);
                }
                match q.iter(&*mem) {
                    Ok(it) => heads.extend(it.map(|c| c.head_index())),
                    Err(e) => {
                        tracing::warn!(
                            "{} {}: queue {} is broken ({e}); it stops until the device is reset",
                            self.dev.kind,
                            self.dev.id,
                            self.index
                        );
                        self.broken.set(true);
                        break;
                    }
                }
            }
            if !heads.is_empty() {
                self.stats.pops_per_pass.record(heads.len() as u64);
                self.stats.requests.add(heads.len() as u64);
            }
            for &head in heads.iter() {
                self.submit(head);
            }
            if self.polling.get() {
                break;
            }
            self.stats.rearms.add(1);
            match self.queue.borrow_mut().enable_notification(&*mem) {
                Ok(true) => continue,
                _ => break,
            }
        }
        *self.heads.borrow_mut() = heads;
    }

    /// Runs the request whose chain starts at `head`.
    fn submit(self: &Rc<Self>, head: u16) {
        if let Some(q) = &self.inflight {
            q.taken(head);
        }
        self.dev.requests[self.index as usize].fetch_add(1, Ordering::Relaxed);
        let chain = self.chain(head);
        self.in_flight.set(self.in_flight.get() + 1);
        let mut waiting = self.waiting.borrow_mut();
        if waiting.is_empty() && self.admits(&chain) {
            drop(waiting);
            self.run(head, chain);
        } else {
            waiting.push_back((head, chain));
        }
    }

    /// The chain at `head`, with every address it names mapped: with lazy memory, what is
    /// missing is mapped, one IOTLB range at a time, and buffers the device writes must
    /// lie in writable ranges.
    fn chain(&self, head: u16) -> Result<Chain, String> {
        // Each pass maps one more range; a chain of (at most) a ring's worth of
        // descriptors cannot need more than that many, and then some for its table.
        for _ in 0..usize::from(self.queue.borrow().size()) + 4 {
            let mem = self.mem.borrow().clone();
            let chain = {
                let q = self.queue.borrow();
                walk_chain(&mem, GuestAddress(q.desc_table()), q.size(), head)
            };
            let Some(lazy) = &self.lazy else {
                return chain.map_err(|e| e.to_string());
            };
            let missing = match &chain {
                Err(WalkError { at: Some(at), .. }) => *at,
                Err(e) => return Err(e.to_string()),
                Ok(c) => match c.unmapped(&mem) {
                    None if c
                        .inn
                        .iter()
                        .all(|s| lazy.writable(s.addr, u64::from(s.len))) =>
                    {
                        return chain.map_err(|e| e.to_string())
                    }
                    None => return Err("device-writable buffer in read-only memory".into()),
                    Some(at) => at,
                },
            };
            match lazy.map(missing) {
                Some(m) => *self.mem.borrow_mut() = m,
                None => return Err(format!("address {missing:#x} is not mapped")),
            }
        }
        Err("chain spans too many unmapped ranges".into())
    }

    fn cost(chain: &Result<Chain, String>) -> usize {
        chain.as_ref().map_or(0, Chain::data_cost)
    }

    /// Whether a request may start now without exceeding the queue's data budget.
    fn admits(&self, chain: &Result<Chain, String>) -> bool {
        let (n, bytes) = self.running.get();
        n == 0 || bytes + Self::cost(chain) <= MAX_QUEUE_BYTES
    }

    /// Starts a request as a task, at once (it runs until it must wait, and is done
    /// without a trip through the run queue if it need not); when it completes, its
    /// budget goes to waiting ones.
    fn run(self: &Rc<Self>, head: u16, chain: Result<Chain, String>) {
        let cost = Self::cost(&chain);
        let (n, bytes) = self.running.get();
        self.running.set((n + 1, bytes + cost));
        let mem = self.mem.borrow().clone();
        let v = self.clone();
        let t0 = head.is_multiple_of(16).then(now_ns);
        stord_aio::spawn_now(Box::pin(async move {
            let len = match chain {
                Ok(chain) => request::execute(&v.dev, &mem, &chain).await,
                Err(e) => {
                    tracing::warn!(
                        "{} {}: queue {}: bad descriptor chain at head {head}: {e}",
                        v.dev.kind,
                        v.dev.id,
                        v.index
                    );
                    0
                }
            };
            let (n, bytes) = v.running.get();
            v.running.set((n - 1, bytes - cost));
            v.complete(head, len);
            if let Some(t0) = t0 {
                v.stats.service_ns.record(now_ns() - t0);
            }
            v.run_waiting();
        }));
    }

    /// Starts waiting requests, in order, while the budget allows.
    fn run_waiting(self: &Rc<Self>) {
        if self.starting_waiting.replace(true) {
            return;
        }
        loop {
            let next = {
                let mut w = self.waiting.borrow_mut();
                match w.front() {
                    Some((_, chain)) if self.admits(chain) => w.pop_front(),
                    _ => None,
                }
            };
            let Some((head, chain)) = next else { break };
            self.run(head, chain);
        }
        self.starting_waiting.set(false);
    }

    /// Publishes one completion in the used ring right away (plain memory writes: a driver
    /// that is awake sees it at once and can queue more while we keep popping, which is
    /// what keeps both sides out of lockstep).
    ///
    /// With EVENT_IDX the driver says in `used_event` which completion it wants to be
    /// interrupted for, so we check at each completion and signal the first one it asked
    /// for at once: a driver asleep in its wait starts waking (a cross-CPU wake-up costs
    /// tens of µs here) while we complete the rest of the batch, instead of after it; the
    /// check is a memory read, and the number of calls is the same. Without EVENT_IDX every
    /// completion would ask for a call, so those are batched into one per loop pass by a
    /// bottom half.
    fn complete(&self, head: u16, len: u32) {
        if self.fault.check(&self.dev.id) {
            self.broken.set(true);
        }
        self.in_flight.set(self.in_flight.get() - 1);
        if self.in_flight.get() == 0 {
            if let Some(tx) = self.drained.take() {
                let _ = tx.try_send(());
            }
        }
        let mut call_now = false;
        {
            let mem = self.mem.borrow();
            let mut q = self.queue.borrow_mut();
            if let Some(i) = &self.inflight {
                i.completing(head);
            }
            match q.add_used(&**mem, head, len) {
                Ok(()) => {
                    if let Some(i) = &self.inflight {
                        i.completed(head, q.next_used());
                    }
                }
                Err(e) => tracing::warn!(
                    "{} {}: queue {}: cannot complete head {head}: {e}",
                    self.dev.kind,
                    self.dev.id,
                    self.index
                ),
            }
            if self.event_idx {
                if q.needs_notification(&**mem).unwrap_or(true) {
                    call_now = true;
                } else {
                    self.stats.calls_skipped.add(1);
                }
            }
        }
        if call_now {
            self.first_unsignalled_ns.set(now_ns());
            self.call();
        }
        if !self.notify_pending.replace(true) {
            self.first_unsignalled_ns.set(now_ns());
            if let Some(bh) = &*self.flush_bh.borrow() {
                bh.schedule();
            }
        }
    }

    /// Interrupts the driver (writes the call eventfd).
    fn call(&self) {
        if let Some(call) = &*self.call.borrow() {
            call.raise();
            self.stats.calls.add(1);
            self.stats
                .used_to_call_ns
                .record(now_ns().saturating_sub(self.first_unsignalled_ns.get()));
        }
    }

    /// End of a loop pass that published completions: without EVENT_IDX, signals the
    /// driver once for all of them if it wants interrupts (with EVENT_IDX `complete` did).
    fn notify(&self) {
        if !self.notify_pending.replace(false) || self.event_idx {
            return;
        }
        let mem = self.mem.borrow();
        let wanted = self
            .queue
            .borrow_mut()
            .needs_notification(&**mem)
            .unwrap_or(true);
        drop(mem);
        if wanted {
            self.call();
        } else {
            self.stats.calls_skipped.add(1);
        }
    }
}
