//! `AioContext`: one event loop, owned by one thread.
//!
//! Its iteration, as named steps, is in [`crate::iteration`]; this module holds the
//! context itself: its state, its handlers and the API other code calls.

use std::any::{Any, TypeId};
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crossbeam_queue::SegQueue;

use crate::bh::{Bh, BhList};
use crate::handler::{
    FdHandlerId, Interest, PollEntry, PollHandler, PollHandlerId, PollSource, Readiness,
};
use crate::notify::Notifier;
use crate::poll::{new_policy, HandlerId, PollParams, PollPolicy};
use crate::reactor::{Event, Reactor, ReactorInfo, ReactorKind};
use crate::remote::{Remote, RemoteMsg};
use crate::slab::Slab;
use crate::stats::{AioStats, StatsSnapshot};
use crate::task::{with_join, Executor, JoinHandle};
use crate::timer::{TimerId, TimerList};

/// Policy id of the notifier's poll handler.
pub(crate) const NOTIFIER_ID: HandlerId = 0;
/// Policy id of the ring's poll handler: completions of operations on peers (sockets,
/// /dev/fuse, eventfds) and fd readiness.
pub(crate) const REACTOR_ID: HandlerId = 1;
/// Policy id of the ring's storage completions. A device's wait and a client's turnaround
/// differ by an order of magnitude and come through the same ring; with one window for
/// both, one device wait longer than `poll-max-ns` reset the window the client's
/// turnaround needed, and the loop fell into sleeping through both (measured on NBD at
/// QD1 over an O_DIRECT file: 0.09 against 1.12 sleeps per request between runs of the
/// same binary, docs/benchmark-notes.md).
pub(crate) const STORAGE_ID: HandlerId = 2;
/// The first policy id of a user poll handler.
const FIRST_USER_ID: HandlerId = 3;

/// The part of a context other threads can reach.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) queue: SegQueue<RemoteMsg>,
    pub(crate) notifier: Notifier,
    pub(crate) stats: AioStats,
    pub(crate) stopping: AtomicBool,
    /// Set once the owning context is gone: nothing will process the queue any more.
    pub(crate) dead: AtomicBool,
    pub(crate) params: Mutex<PollParams>,
    pub(crate) info: OnceLock<ReactorInfo>,
    pub(crate) tid: AtomicI32,
    pub(crate) sched_slice_ns: u64,
}

impl Shared {
    /// Publishes a message, then notifies.
    pub(crate) fn send(&self, msg: RemoteMsg) {
        self.queue.push(msg);
        self.notifier.notify(&self.stats);
        if self.dead.load(Ordering::Acquire) {
            self.discard_queue();
        }
    }

    /// Drops queued messages (their futures and closures) once nobody will run them.
    pub(crate) fn discard_queue(&self) {
        while let Some(msg) = self.queue.pop() {
            drop(msg);
        }
    }
}

pub(crate) struct FdEntry {
    pub(crate) cb: Option<Box<dyn FnMut(Readiness)>>,
}

/// The loop-thread half of a context.
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    pub(crate) reactor: RefCell<Reactor>,
    pub(crate) exec: Executor,
    pub(crate) bhs: BhList,
    pub(crate) timers: RefCell<TimerList>,
    pub(crate) poll_entries: RefCell<Vec<Option<PollEntry>>>,
    pub(crate) fd_handlers: RefCell<Slab<FdEntry>>,
    pub(crate) policy: RefCell<Box<dyn PollPolicy>>,
    pub(crate) poll_started: Cell<bool>,
    /// `poll-yield-ns` in force.
    pub(crate) yield_ns: Cell<u64>,
    /// When the last iteration started (the policy weighs whole iterations).
    pub(crate) last_start: Cell<u64>,

    pub(crate) events: RefCell<Vec<Event>>,
    pub(crate) ready: RefCell<Vec<HandlerId>>,
    pub(crate) windows: RefCell<Vec<(Option<HandlerId>, u64)>>,
    pub(crate) windows_published: Cell<bool>,
    pub(crate) users: RefCell<UserHandlers>,
    /// State the loop's users keep per context ([`AioContext::local`]), by type.
    pub(crate) locals: RefCell<Vec<(TypeId, Rc<dyn Any>)>>,
}

pub(crate) type UserHandlers = Rc<[(HandlerId, Rc<dyn PollHandler>)]>;

thread_local! {
    static CURRENT: RefCell<Option<Rc<Inner>>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's context; panics if the thread has none.
pub(crate) fn with_current<R>(f: impl FnOnce(&Rc<Inner>) -> R) -> R {
    try_with_current(f).expect("no AioContext on this thread")
}

/// Runs `f` with this thread's context, if it has one.
pub(crate) fn try_with_current<R>(f: impl FnOnce(&Rc<Inner>) -> R) -> Option<R> {
    let cur = CURRENT.try_with(|c| c.borrow().clone()).ok().flatten();
    cur.map(|c| f(&c))
}

/// The time slice a loop thread asks the fair scheduler for unless told otherwise: the
/// kernel's shortest. A loop runs in bursts of a few microseconds and then sleeps, so a
/// short slice costs it nothing, and it lets the thread run as soon as its I/O wakes it
/// rather than after the client it just woke (see [`AioContextOptions::sched_slice_ns`]).
pub const DEFAULT_SCHED_SLICE_NS: u64 = 100_000;

/// Options for a new context.
#[derive(Debug, Clone)]
pub struct AioContextOptions {
    /// A name for statistics and thread names.
    pub name: String,
    /// Which reactor to use.
    pub reactor: ReactorKind,
    /// Initial polling parameters.
    pub poll: PollParams,
    /// The fair-scheduler slice the thread asks for (Linux 6.12's custom slices, which the
    /// kernel clamps to 0.1-100 ms); 0 asks for the kernel's default rather than the slice
    /// the thread inherited. With the default slice (about 1.4 ms on two CPUs) a client
    /// woken by the loop's reply preempts the loop before it can go back to sleep, and a
    /// loop woken by a request waits behind the client that sent it: one extra context
    /// switch per request and tens of microseconds of latency at QD1. Threads the user put
    /// in another policy (real-time) are left alone.
    pub sched_slice_ns: u64,
}

impl Default for AioContextOptions {
    fn default() -> Self {
        Self {
            name: String::new(),
            reactor: ReactorKind::default(),
            poll: PollParams::default(),
            sched_slice_ns: DEFAULT_SCHED_SLICE_NS,
        }
    }
}

/// An event loop owned by the thread that created it (it is neither Send nor Sync).
pub struct AioContext {
    inner: Rc<Inner>,
    /// The instance `new` returned (tears the context down on drop), as opposed to the
    /// borrowed views [`with_current_context`] lends out.
    owner: bool,
}

/// Runs `f` with the calling thread's context (e.g. inside a task or a `Remote::run`
/// closure on an IoThread). None if the thread has no context.
pub fn with_current_context<R>(f: impl FnOnce(&AioContext) -> R) -> Option<R> {
    try_with_current(|inner| {
        let view = AioContext {
            inner: inner.clone(),
            owner: false,
        };
        f(&view)
    })
}

impl AioContext {
    /// Creates the calling thread's context. A thread has at most one.
    pub fn new(opts: AioContextOptions) -> io::Result<Self> {
        opts.poll
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        if try_with_current(|_| ()).is_some() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "this thread already has an AioContext",
            ));
        }
        // Always set, 0 too: a thread inherits its creator's slice. A hint the loop works
        // without (a kernel before 6.12 takes it and ignores it; one that refuses it
        // leaves the thread as it was).
        let _ = crate::sys::set_sched_slice(opts.sched_slice_ns);
        let notifier = Notifier::new()?;
        let reactor = Reactor::new(opts.reactor, notifier.fd())?;
        let shared = Arc::new(Shared {
            name: opts.name,
            queue: SegQueue::new(),
            notifier,
            stats: AioStats::default(),
            stopping: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            params: Mutex::new(opts.poll),
            info: OnceLock::new(),
            tid: AtomicI32::new(crate::sys::gettid()),
            sched_slice_ns: opts.sched_slice_ns,
        });
        let _ = shared.info.set(reactor.info());
        let is_uring = matches!(reactor, Reactor::Uring(_));
        let mut policy = new_policy(&opts.poll);
        policy.add_handler(NOTIFIER_ID);
        let mut entries = vec![
            Some(PollEntry {
                name: "notifier".into(),
                source: PollSource::Notifier,
            }),
            None,
            None,
        ];
        if is_uring {
            policy.add_handler(REACTOR_ID);
            entries[REACTOR_ID] = Some(PollEntry {
                name: "io_uring".into(),
                source: PollSource::Reactor,
            });
            policy.add_handler(STORAGE_ID);
            entries[STORAGE_ID] = Some(PollEntry {
                name: "io_uring-storage".into(),
                source: PollSource::StorageCompletions,
            });
        }
        let inner = Rc::new(Inner {
            shared,
            reactor: RefCell::new(reactor),
            exec: Executor::default(),
            bhs: BhList::default(),
            timers: RefCell::default(),
            poll_entries: RefCell::new(entries),
            fd_handlers: RefCell::default(),
            policy: RefCell::new(policy),
            poll_started: Cell::new(false),
            yield_ns: Cell::new(opts.poll.yield_ns),
            last_start: Cell::new(0),
            events: RefCell::default(),
            ready: RefCell::default(),
            windows: RefCell::default(),
            windows_published: Cell::new(false),
            users: RefCell::new(Rc::new([])),
            locals: RefCell::default(),
        });
        CURRENT.with(|c| *c.borrow_mut() = Some(inner.clone()));
        inner.publish_windows();
        Ok(Self { inner, owner: true })
    }

    /// The name it was created with.
    pub fn name(&self) -> &str {
        &self.inner.shared.name
    }

    /// A handle for other threads.
    pub fn remote(&self) -> Remote {
        Remote {
            shared: self.inner.shared.clone(),
        }
    }

    /// Which reactor this context runs, with the io_uring flags in force.
    pub fn reactor_info(&self) -> ReactorInfo {
        self.inner.reactor.borrow().info()
    }

    /// Statistics now.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.shared.stats.snapshot()
    }

    /// Runs one loop iteration; with `blocking`, waits for something to happen first.
    /// Returns whether any work (task, bottom half, timer, handler) was done.
    pub fn run_once(&self, blocking: bool) -> bool {
        self.inner.run_once(blocking)
    }

    /// Runs the loop until `future` completes, and returns its output.
    pub fn block_on<F: Future + 'static>(&self, future: F) -> F::Output {
        let handle = self.spawn(future);
        loop {
            if let Some(v) = handle.try_take() {
                return v;
            }
            self.run_once(true);
        }
    }

    /// Runs the loop until a `Remote` asks it to stop ([`Remote`] via [`IoThread`]).
    ///
    /// [`IoThread`]: crate::IoThread
    pub fn run_until_stopped(&self) {
        while !self.inner.shared.stopping.load(Ordering::Acquire) {
            self.run_once(true);
        }
    }

    /// Spawns a task on this context.
    pub fn spawn<F: Future + 'static>(&self, future: F) -> JoinHandle<F::Output> {
        let (fut, handle) = with_join(future);
        self.inner.exec.spawn(&self.inner.shared, fut);
        handle
    }

    /// Creates a bottom half.
    pub fn new_bh(&self, cb: impl FnMut() + 'static) -> Bh {
        let (key, scheduled) = self.inner.bhs.add(Box::new(cb));
        Bh {
            ctx: Rc::downgrade(&self.inner),
            shared: self.inner.shared.clone(),
            key,
            scheduled,
        }
    }

    /// Runs `cb` once the monotonic clock reaches `deadline_ns`.
    pub fn add_timer(&self, deadline_ns: u64, cb: impl FnOnce() + 'static) -> TimerId {
        self.inner.add_timer_at(deadline_ns, cb)
    }

    /// Cancels a timer; false if it already fired or was cancelled.
    pub fn cancel_timer(&self, id: TimerId) -> bool {
        self.inner.cancel_timer(id)
    }

    /// Registers a poll handler.
    pub fn add_poll_handler(&self, h: Rc<dyn PollHandler>) -> PollHandlerId {
        self.inner.add_poll_handler(h)
    }

    /// Unregisters a poll handler.
    pub fn remove_poll_handler(&self, id: PollHandlerId) {
        self.inner.remove_poll_handler(id)
    }

    /// Calls `cb` whenever `fd` is ready for `interest` (level-triggered). One handler
    /// per fd.
    pub fn set_fd_handler(
        &self,
        fd: RawFd,
        interest: Interest,
        cb: impl FnMut(Readiness) + 'static,
    ) -> io::Result<FdHandlerId> {
        self.inner.set_fd_handler(fd, interest, Box::new(cb))
    }

    /// Unregisters an fd handler.
    pub fn remove_fd_handler(&self, id: FdHandlerId) {
        self.inner.remove_fd_handler(id)
    }

    /// Changes polling parameters (and the policy) now.
    pub fn set_poll_params(&self, params: PollParams) -> Result<(), String> {
        params.validate()?;
        *self
            .inner
            .shared
            .params
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = params;
        self.inner.apply_poll_params(params);
        Ok(())
    }

    /// The counter `name` in this loop's statistics (shared by everyone who asks for the
    /// same name), for what the loop's users measure; see [`Counter`](crate::Counter).
    pub fn counter(&self, name: &str) -> Arc<crate::Counter> {
        self.inner.shared.stats.counter(name)
    }

    /// The histogram `name` in this loop's statistics (shared by name).
    pub fn histogram(&self, name: &str) -> Arc<crate::Histogram> {
        self.inner.shared.stats.histogram(name)
    }

    /// This context's instance of `T`, made by `init` the first time it is asked for: state
    /// a user of the loop keeps per IoThread (a Linux AIO context, a thread pool). It lives
    /// as long as the context and is dropped with it, after its tasks and handlers, so a
    /// thread that runs one context after another never sees the previous one's state.
    /// `init` may use the context (register handlers, even ask for other locals).
    pub fn local<T: 'static, E>(
        &self,
        init: impl FnOnce(&AioContext) -> Result<T, E>,
    ) -> Result<Rc<T>, E> {
        let id = TypeId::of::<T>();
        let found = self
            .inner
            .locals
            .borrow()
            .iter()
            .find(|(t, _)| *t == id)
            .map(|(_, v)| v.clone());
        if let Some(v) = found {
            return Ok(v
                .downcast::<T>()
                .unwrap_or_else(|_| unreachable!("keyed by type")));
        }
        let v = Rc::new(init(self)?);
        self.inner.locals.borrow_mut().push((id, v.clone()));
        Ok(v)
    }

    /// Number of live tasks.
    pub fn task_count(&self) -> usize {
        self.inner.exec.len()
    }
}

impl Drop for AioContext {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        let inner = &self.inner;
        // Dropping tasks drops their in-flight operations, which park their buffers in the
        // reactor; then the reactor waits for the kernel to release them.
        inner.exec.clear();
        inner.bhs.clear();
        inner.timers.borrow_mut().clear();
        let fds = inner.fd_handlers.borrow_mut().drain();
        drop(fds);
        let entries = std::mem::take(&mut *inner.poll_entries.borrow_mut());
        drop(entries);
        // Users' per-context state, newest first (it may use what was made before it).
        let mut locals = std::mem::take(&mut *inner.locals.borrow_mut());
        while let Some(l) = locals.pop() {
            drop(l);
        }
        while let Some(msg) = inner.shared.queue.pop() {
            drop(msg);
        }
        inner.reactor.borrow_mut().shutdown();
        inner.shared.stopping.store(true, Ordering::Release);
        inner.shared.dead.store(true, Ordering::Release);
        inner.shared.discard_queue();
        CURRENT.with(|c| c.borrow_mut().take());
    }
}

impl Inner {
    pub(crate) fn add_timer_at(&self, deadline_ns: u64, cb: impl FnOnce() + 'static) -> TimerId {
        self.timers.borrow_mut().add(deadline_ns, Box::new(cb))
    }

    pub(crate) fn cancel_timer(&self, id: TimerId) -> bool {
        self.timers.borrow_mut().cancel(id)
    }

    pub(crate) fn spawn_local(&self, fut: crate::task::LocalFuture) {
        self.exec.spawn(&self.shared, fut);
    }

    pub(crate) fn spawn_local_now(&self, fut: crate::task::LocalFuture) {
        self.exec.spawn_now(&self.shared, fut);
    }

    fn add_poll_handler(&self, h: Rc<dyn PollHandler>) -> PollHandlerId {
        let entry = PollEntry {
            name: h.name().to_string(),
            source: PollSource::User(h),
        };
        let mut entries = self.poll_entries.borrow_mut();
        let id = match entries.iter().skip(FIRST_USER_ID).position(Option::is_none) {
            Some(i) => i + FIRST_USER_ID,
            None => {
                entries.push(None);
                entries.len() - 1
            }
        };
        entries[id] = Some(entry);
        drop(entries);
        self.rebuild_users();
        self.policy.borrow_mut().add_handler(id);
        self.windows_published.set(false);
        if self.poll_started.get() {
            if let Some(PollSource::User(h)) = self.source_of(id) {
                h.poll_begin();
            }
        }
        self.publish_windows();
        PollHandlerId(id)
    }

    fn remove_poll_handler(&self, id: PollHandlerId) {
        if id.0 < FIRST_USER_ID {
            return;
        }
        let removed = self
            .poll_entries
            .borrow_mut()
            .get_mut(id.0)
            .and_then(Option::take);
        if removed.is_some() {
            self.rebuild_users();
            self.policy.borrow_mut().remove_handler(id.0);
            self.windows_published.set(false);
            self.publish_windows();
        }
        drop(removed);
    }

    fn source_of(&self, id: HandlerId) -> Option<PollSource> {
        let entries = self.poll_entries.borrow();
        match entries.get(id)?.as_ref()?.source {
            PollSource::Notifier => Some(PollSource::Notifier),
            PollSource::Reactor => Some(PollSource::Reactor),
            PollSource::StorageCompletions => Some(PollSource::StorageCompletions),
            PollSource::User(ref h) => Some(PollSource::User(h.clone())),
        }
    }

    pub(crate) fn user_handlers(&self) -> UserHandlers {
        self.users.borrow().clone()
    }

    fn rebuild_users(&self) {
        let list: Vec<_> = self
            .poll_entries
            .borrow()
            .iter()
            .enumerate()
            .filter_map(|(i, e)| match e {
                Some(PollEntry {
                    source: PollSource::User(h),
                    ..
                }) => Some((i, h.clone())),
                _ => None,
            })
            .collect();
        *self.users.borrow_mut() = list.into();
    }

    fn set_fd_handler(
        &self,
        fd: RawFd,
        interest: Interest,
        cb: Box<dyn FnMut(Readiness)>,
    ) -> io::Result<FdHandlerId> {
        let key = self
            .fd_handlers
            .borrow_mut()
            .insert(FdEntry { cb: Some(cb) });
        if let Err(e) = self.reactor.borrow_mut().add_fd(fd, interest.0, key) {
            self.fd_handlers.borrow_mut().remove(key);
            return Err(e);
        }
        Ok(FdHandlerId(key))
    }

    fn remove_fd_handler(&self, id: FdHandlerId) {
        let removed = self.fd_handlers.borrow_mut().remove(id.0);
        if removed.is_some() {
            self.reactor.borrow_mut().remove_fd(id.0);
        }
        drop(removed);
    }

    pub(crate) fn apply_poll_params(&self, params: PollParams) {
        self.yield_ns.set(params.yield_ns);
        let mut policy = self.policy.borrow_mut();
        if policy.kind() == params.policy {
            policy.set_params(&params);
        } else {
            let mut p = new_policy(&params);
            for (i, e) in self.poll_entries.borrow().iter().enumerate() {
                if e.is_some() {
                    p.add_handler(i);
                }
            }
            *policy = p;
        }
        drop(policy);
        self.publish_windows();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iteration::merge_fd_events;
    use crate::slab::Key;

    fn ev(index: usize, revents: u32) -> Event {
        Event::Fd {
            key: Key { index, gen: 0 },
            revents,
        }
    }

    #[test]
    fn one_event_per_fd_readiness_bits_merged_order_kept() {
        let mut v = vec![ev(3, 1), ev(1, 4), ev(3, 8), ev(2, 1), ev(1, 1)];
        merge_fd_events(&mut v);
        let got: Vec<(usize, u32)> = v
            .iter()
            .map(|Event::Fd { key, revents }| (key.index, *revents))
            .collect();
        assert_eq!(got, vec![(3, 9), (1, 5), (2, 1)]);
    }

    /// Per-context state: one instance per context, dropped with it, never seen by the
    /// next context on the same thread.
    #[test]
    fn locals_live_and_die_with_their_context() {
        struct Probe(u32, Rc<Cell<u32>>);
        impl Drop for Probe {
            fn drop(&mut self) {
                self.1.set(self.1.get() + 1);
            }
        }
        let drops = Rc::new(Cell::new(0));
        let made = Cell::new(0);
        let make = |_: &AioContext| -> Result<Probe, ()> {
            made.set(made.get() + 1);
            Ok(Probe(made.get(), drops.clone()))
        };
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let a = ctx.local(make).unwrap();
        let b = ctx.local(make).unwrap();
        assert!(Rc::ptr_eq(&a, &b));
        assert_eq!(made.get(), 1);
        assert!(ctx.local(|_| Err::<u64, _>("refused")).is_err());
        drop((a, b));
        drop(ctx);
        assert_eq!(drops.get(), 1, "the context's state outlived it");
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        assert_eq!(
            ctx.local(make).unwrap().0,
            2,
            "a new context got the old state"
        );
    }
}
