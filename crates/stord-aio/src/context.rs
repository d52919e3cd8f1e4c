//! `AioContext`: one event loop, owned by one thread.
//!
//! One iteration ([`AioContext::run_once`]) is, in order, with the methods of `Inner` that
//! do each step (they hand an `Iteration` on, which carries the step's results):
//! 1. `begin_iteration`: compute the timeout: 0 if work is already runnable, else until
//!    the next timer;
//! 2. `poll_window`, `submit_queued`: the policy's window; if there is one, submit the
//!    operations queued during the last iteration before the spin (one io_uring_enter;
//!    without a window the wait of step 4 submits them);
//! 3. `run_poll_handlers`: busy-poll the poll handlers for the window (memory peeks
//!    only): the notifier's `notified` flag, the ring's CQ tail and TASKRUN flag, user
//!    handlers;
//! 4. `leave_poll_mode`, `wait`: if nothing turned up, end poll mode with one last peek,
//!    announce the block (notify_me) and wait in the reactor;
//! 5. `note_ready`, `accept_notification`, `dispatch`: note which poll handlers had an
//!    event, then dispatch: remote messages, fd handlers, ready poll handlers (not
//!    polling time);
//! 6. `adjust_policy`: let the policy learn from the wait (`block_ns` = polling +
//!    blocking), per handler that had an event; the ring counts as two, its storage
//!    completions apart from the rest (operations marked
//!    [`on_storage`](crate::op::Op::on_storage));
//! 7. `run_bhs_tasks_timers`: run bottom halves, runnable tasks and expired timers.

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
use crate::poll::{new_policy, HandlerId, Observation, PollParams, PollPolicy};
use crate::reactor::{Event, Reactor, ReactorInfo, ReactorKind, Reaped};
use crate::remote::{Remote, RemoteMsg};
use crate::slab::Slab;
use crate::stats::{AioStats, HandlerWindow, StatsSnapshot};
use crate::sys::now_ns;
use crate::task::{with_join, Executor, JoinHandle};
use crate::timer::{TimerId, TimerList};

/// Policy id of the notifier's poll handler.
const NOTIFIER_ID: HandlerId = 0;
/// Policy id of the ring's poll handler: completions of operations on peers (sockets,
/// /dev/fuse, eventfds) and fd readiness.
const REACTOR_ID: HandlerId = 1;
/// Policy id of the ring's storage completions. A device's wait and a client's turnaround
/// differ by an order of magnitude and come through the same ring; with one window for
/// both, one device wait longer than `poll-max-ns` reset the window the client's
/// turnaround needed, and the loop fell into sleeping through both (measured on NBD at
/// QD1 over an O_DIRECT file: 0.09 against 1.12 sleeps per request between runs of the
/// same binary, docs/benchmark-notes.md).
const STORAGE_ID: HandlerId = 2;
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

struct FdEntry {
    cb: Option<Box<dyn FnMut(Readiness)>>,
}

/// The loop-thread half of a context.
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    pub(crate) reactor: RefCell<Reactor>,
    pub(crate) exec: Executor,
    pub(crate) bhs: BhList,
    timers: RefCell<TimerList>,
    poll_entries: RefCell<Vec<Option<PollEntry>>>,
    fd_handlers: RefCell<Slab<FdEntry>>,
    policy: RefCell<Box<dyn PollPolicy>>,
    poll_started: Cell<bool>,
    /// `poll-yield-ns` in force.
    yield_ns: Cell<u64>,
    /// When the last iteration started (the policy weighs whole iterations).
    last_start: Cell<u64>,

    events: RefCell<Vec<Event>>,
    ready: RefCell<Vec<HandlerId>>,
    windows: RefCell<Vec<(Option<HandlerId>, u64)>>,
    windows_published: Cell<bool>,
    users: RefCell<UserHandlers>,
    /// State the loop's users keep per context ([`AioContext::local`]), by type.
    locals: RefCell<Vec<(TypeId, Rc<dyn Any>)>>,
}

type UserHandlers = Rc<[(HandlerId, Rc<dyn PollHandler>)]>;

/// What one loop iteration hands from step to step (the module's doc numbers them).
struct Iteration {
    /// When it started.
    start: u64,
    /// Since the previous iteration started (0 for the first).
    elapsed_ns: u64,
    /// How long the wait may block: `None` until an event comes, `Some(0)` not at all.
    timeout: Option<u64>,
    /// The poll handlers with an event: the spin's hits, then (from step 5) every handler
    /// the policy learns about. The context's buffer, lent for the iteration.
    ready: Vec<HandlerId>,
    /// The fd readiness the reactor reported. The context's buffer, lent until dispatch.
    events: Vec<Event>,
    /// What the reactor's waits reaped.
    reaped: Reaped,
    /// How long the spin counts as polling (0 without one).
    polled_ns: u64,
    /// How long the loop slept in the reactor, if it did.
    slept_ns: Option<u64>,
    /// From the start to the end of the wait: polling and blocking.
    block_ns: u64,
    /// The work the wait brought, for policies that weigh polling per unit of work.
    work: u64,
    /// The operations that completed.
    served: u64,
}

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

/// Options for a new context.
#[derive(Debug, Clone, Default)]
pub struct AioContextOptions {
    /// A name for statistics and thread names.
    pub name: String,
    /// Which reactor to use.
    pub reactor: ReactorKind,
    /// Initial polling parameters.
    pub poll: PollParams,
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

/// Merges events of the same fd handler (OR of their readiness bits), keeping the order of
/// first appearance.
fn merge_fd_events(events: &mut Vec<Event>) {
    let mut i = 0;
    while i < events.len() {
        let Event::Fd { key, .. } = events[i];
        let mut j = i + 1;
        while j < events.len() {
            let Event::Fd { key: k2, revents } = events[j];
            if k2 == key {
                let Event::Fd { revents: r, .. } = &mut events[i];
                *r |= revents;
                events.remove(j);
            } else {
                j += 1;
            }
        }
        i += 1;
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

    fn user_handlers(&self) -> UserHandlers {
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

    /// Work that must run without waiting.
    fn has_immediate_work(&self) -> bool {
        self.exec.has_runnable() || self.bhs.has_ready() || !self.shared.queue.is_empty()
    }

    fn timer_timeout(&self, now: u64) -> Option<u64> {
        self.timers
            .borrow_mut()
            .next_deadline()
            .map(|d| d.saturating_sub(now))
    }

    /// One pass over the poll handlers: memory peeks only.
    fn poll_all(&self, ready: &mut Vec<HandlerId>) {
        let entries = self.poll_entries.borrow();
        for (id, e) in entries.iter().enumerate() {
            let Some(e) = e else { continue };
            let hit = match &e.source {
                PollSource::Notifier => self.shared.notifier.peek(),
                PollSource::Reactor => self.reactor.borrow().peek(),
                PollSource::StorageCompletions => false,
                PollSource::User(h) => h.poll(),
            };
            if hit {
                ready.push(id);
            }
        }
    }

    fn set_poll_started(&self, on: bool) {
        if self.poll_started.replace(on) == on {
            return;
        }
        for (_, h) in self.user_handlers().iter() {
            if on {
                h.poll_begin();
            } else {
                h.poll_end();
            }
        }
    }

    /// One iteration: the steps the module's doc numbers, in order.
    fn run_once(&self, blocking: bool) -> bool {
        let mut it = self.begin_iteration(blocking);
        let window = self.poll_window(it.timeout);
        if window > 0 {
            self.submit_queued();
            self.run_poll_handlers(&mut it, window);
        }
        self.leave_poll_mode(&mut it);
        self.wait(&mut it);
        let users = self.note_ready(&mut it);
        self.accept_notification(it.reaped);
        let mut progress = self.dispatch(&mut it, &users);
        self.adjust_policy(it);
        progress |= self.run_bhs_tasks_timers();
        progress
    }

    /// Step 1: counts the iteration and computes its timeout: 0 if work is already
    /// runnable, else until the next timer (`None`: no timer, wait for an event).
    #[inline]
    fn begin_iteration(&self, blocking: bool) -> Iteration {
        AioStats::add(&self.shared.stats.iterations, 1);
        let start = now_ns();
        let last_start = self.last_start.replace(start);
        let elapsed_ns = if last_start == 0 {
            0
        } else {
            start - last_start
        };
        let timeout = if blocking && !self.has_immediate_work() {
            self.timer_timeout(start)
        } else {
            Some(0)
        };
        let mut ready = std::mem::take(&mut *self.ready.borrow_mut());
        ready.clear();
        Iteration {
            start,
            elapsed_ns,
            timeout,
            ready,
            events: std::mem::take(&mut *self.events.borrow_mut()),
            reaped: Reaped::default(),
            polled_ns: 0,
            slept_ns: None,
            block_ns: 0,
            work: 0,
            served: 0,
        }
    }

    /// Step 2, the window to poll for: none when the loop must not wait, and the ring's
    /// storage completions count only while one is owed.
    #[inline]
    fn poll_window(&self, timeout: Option<u64>) -> u64 {
        if timeout == Some(0) {
            0
        } else if self.reactor.borrow().storage_owed() {
            self.policy.borrow().window_ns()
        } else {
            // No storage completion can come: polling for one only burns the CPU.
            self.policy.borrow().window_ns_without(STORAGE_ID)
        }
    }

    /// Step 2, before a spin: what the last iteration queued goes out, so the device and
    /// the peers work while the loop polls. Without a window the wait submits it in the
    /// same io_uring_enter that waits (one system call, not two).
    #[inline]
    fn submit_queued(&self) {
        self.reactor.borrow_mut().flush();
    }

    /// Step 3: busy-polls the poll handlers (memory peeks only) until one has an event or
    /// the window (or the timeout, if sooner) is over; a hit leaves nothing to wait for.
    #[inline]
    fn run_poll_handlers(&self, it: &mut Iteration, window: u64) {
        let stats = &self.shared.stats;
        AioStats::add(&stats.polls_attempted, 1);
        let start = it.start;
        let limit = it.timeout.map_or(window, |t| t.min(window));
        self.set_poll_started(true);
        let mut now;
        // Polite polling: a runnable thread on this CPU gets it every `yield_ns`.
        let yield_ns = self.yield_ns.get();
        let mut next_yield = start + yield_ns;
        loop {
            self.poll_all(&mut it.ready);
            now = now_ns();
            if !it.ready.is_empty() || now - start >= limit {
                break;
            }
            if yield_ns > 0 && now >= next_yield {
                crate::sys::yield_cpu();
                next_yield = now_ns() + yield_ns;
            }
            std::hint::spin_loop();
        }
        let elapsed = now - start;
        AioStats::add(&stats.poll_ns, elapsed);
        // Past the window the loop was yielding to another thread, not spinning.
        it.polled_ns = elapsed.clamp(1, limit.max(1));
        if it.ready.is_empty() {
            AioStats::add(&stats.poll_misses, 1);
            it.timeout = it.timeout.map(|t| t.saturating_sub(elapsed));
        } else {
            AioStats::add(&stats.poll_hits, 1);
            it.timeout = Some(0);
        }
    }

    /// Step 4, before a wait that may block: handlers re-enable notifications, then one
    /// final peek so nothing that arrived in between is slept through.
    #[inline]
    fn leave_poll_mode(&self, it: &mut Iteration) {
        if it.timeout != Some(0) && self.poll_started.get() {
            self.set_poll_started(false);
            self.poll_all(&mut it.ready);
            if !it.ready.is_empty() {
                it.timeout = Some(0);
            }
        }
    }

    /// Step 4, the wait: announces the block (notify_me) and waits in the reactor, unless
    /// there is work already; then only reaps what the ring has, if it has to.
    #[inline]
    fn wait(&self, it: &mut Iteration) {
        let stats = &self.shared.stats;
        if it.timeout != Some(0) && self.shared.notifier.prepare_block() {
            let t0 = now_ns();
            it.reaped = self.reactor.borrow_mut().wait(it.timeout, &mut it.events);
            let t1 = now_ns();
            self.shared.notifier.finish_block();
            it.slept_ns = Some(t1 - t0);
            AioStats::add(&stats.blocked_ns, t1 - t0);
            AioStats::add(&stats.blocking_waits, 1);
        } else {
            self.shared.notifier.finish_block();
            let mut reactor = self.reactor.borrow_mut();
            if reactor.need_wait() {
                it.reaped = it.reaped.merge(reactor.wait(Some(0), &mut it.events));
            }
        }
        it.block_ns = now_ns() - it.start;
    }

    /// Step 5, first: which poll handlers had an event this iteration (before `accept`
    /// clears the notifier's flag, and counting the ring if it produced completions), and
    /// the work the wait brought. Returns the user handlers as this iteration saw them.
    #[inline]
    fn note_ready(&self, it: &mut Iteration) -> UserHandlers {
        let ready = &mut it.ready;
        ready.clear();
        let Reaped {
            completions,
            storage,
            peer,
            notified,
        } = it.reaped;
        if self.shared.notifier.peek() || notified {
            ready.push(NOTIFIER_ID);
        }
        if matches!(*self.reactor.borrow(), Reactor::Uring(_)) {
            // Only the peers' completions teach the ring's window: a timeout or a
            // cancellation of our own tells nothing about anyone's turnaround.
            if peer > 0 {
                ready.push(REACTOR_ID);
            }
            if storage > 0 {
                ready.push(STORAGE_ID);
            }
        }
        let users = self.user_handlers();
        let mut users_ready = 0;
        for (id, h) in users.iter() {
            if h.poll() {
                ready.push(*id);
                users_ready += 1;
            }
        }
        // The work this wait brought, for policies that weigh polling per unit of work:
        // completions, and ready user handlers. An fd's readiness is not counted when a
        // user handler was ready too: that is the handler's own kick (a virtqueue's eventfd),
        // which comes only while the loop sleeps, and would make sleeping look twice as
        // productive as polling.
        let fd_events = it.events.len() as u64;
        it.work = (completions as u64).saturating_sub(fd_events)
            + if users_ready > 0 {
                users_ready
            } else {
                fd_events
            };
        // Operations that completed: the ring's completions less fd readiness.
        it.served = ((storage + peer) as u64).saturating_sub(fd_events);
        users
    }

    /// Step 5, then: consumes the notification (work published after this notifies
    /// again), drains the eventfd if it fired, and counts the wait's completions.
    #[inline]
    fn accept_notification(&self, reaped: Reaped) {
        let stats = &self.shared.stats;
        self.shared.notifier.accept();
        if reaped.notified && self.shared.notifier.drain() > 0 {
            AioStats::add(&stats.eventfd_wakeups, 1);
        }
        AioStats::add(&stats.completions, reaped.completions as u64);
        AioStats::add(&stats.ring_enters, self.reactor.borrow_mut().take_enters());
        stats
            .completions_per_iteration
            .record(reaped.completions as u64);
    }

    /// Step 5, dispatch (none of it counts as polling time): remote messages, fd handlers,
    /// then the user poll handlers that had an event. Whether anything ran.
    #[inline]
    fn dispatch(&self, it: &mut Iteration, users: &UserHandlers) -> bool {
        // One call per fd: two reaps in one iteration can both report the same fd (its
        // re-armed poll completes again before the handler has consumed the readiness), and
        // a handler that reads a blocking fd must not be called for readiness it already
        // took.
        if it.events.len() > 1 {
            merge_fd_events(&mut it.events);
        }
        let mut progress = self.drain_remote();
        progress |= self.dispatch_fd_events(&mut it.events);
        *self.events.borrow_mut() = std::mem::take(&mut it.events);
        for (id, h) in users.iter() {
            if it.ready.contains(id) {
                h.ready();
                progress = true;
            }
        }
        progress
    }

    /// Calls each fd's handler with its readiness, emptying `events`. Whether any ran.
    #[inline]
    fn dispatch_fd_events(&self, events: &mut Vec<Event>) -> bool {
        let mut progress = false;
        for ev in events.drain(..) {
            let Event::Fd { key, revents } = ev;
            let cb = self
                .fd_handlers
                .borrow_mut()
                .get_mut(key)
                .and_then(|e| e.cb.take());
            if let Some(mut cb) = cb {
                cb(Readiness(revents));
                progress = true;
                // The callback may have removed its own handler (and a new one may have
                // taken the key since): put it back only into its own, still empty slot.
                if let Some(e) = self.fd_handlers.borrow_mut().get_mut(key) {
                    if e.cb.is_none() {
                        e.cb = Some(cb);
                    }
                }
            }
        }
        progress
    }

    /// Step 6: the policy learns from the wait, per handler that had an event, and its
    /// windows are published. The iteration's buffers go back for the next one.
    #[inline]
    fn adjust_policy(&self, it: Iteration) {
        let cpu_ns = self
            .policy
            .borrow()
            .wants_cpu_ns()
            .then(crate::sys::thread_cpu_ns);
        self.policy.borrow_mut().adjust(&Observation {
            block_ns: it.block_ns,
            slept_ns: it.slept_ns,
            events: &it.ready,
            polled_ns: it.polled_ns,
            work: it.work,
            served: it.served,
            elapsed_ns: it.elapsed_ns,
            cpu_ns,
        });
        *self.ready.borrow_mut() = it.ready;
        self.publish_windows();
    }

    /// Step 7: bottom halves, runnable tasks and expired timers, in that order. Whether
    /// any ran.
    #[inline]
    fn run_bhs_tasks_timers(&self) -> bool {
        let mut progress = self.bhs.run() > 0;
        progress |= self.exec.run() > 0;
        progress |= self.run_timers() > 0;
        progress
    }

    fn drain_remote(&self) -> bool {
        let mut any = false;
        while let Some(msg) = self.shared.queue.pop() {
            any = true;
            match msg {
                RemoteMsg::Spawn(fut) => self.exec.spawn(&self.shared, fut),
                RemoteMsg::Wake(w) => self.exec.wake_remote(w),
                RemoteMsg::Bh(key) => self.bhs.enqueue(key),
                RemoteMsg::SetPoll(p) => self.apply_poll_params(p),
                RemoteMsg::Call(f) => f(),
            }
        }
        any
    }

    fn run_timers(&self) -> usize {
        let now = now_ns();
        let mut n = 0;
        loop {
            let cb = self.timers.borrow_mut().pop_expired(now);
            let Some(cb) = cb else { break };
            cb();
            n += 1;
        }
        n
    }

    /// Copies the policy's windows into the shared statistics when they change.
    fn publish_windows(&self) {
        let policy = self.policy.borrow();
        let window = policy.window_ns();
        let mut cur = self.windows.borrow_mut();
        let before = cur.len();
        policy.windows(&mut cur);
        let changed = cur[..before] != cur[before..];
        if !changed && self.windows_published.get() {
            cur.truncate(before);
            return;
        }
        cur.drain(..before);
        self.windows_published.set(true);
        let entries = self.poll_entries.borrow();
        let named: Vec<HandlerWindow> = cur
            .iter()
            .map(|(id, ns)| HandlerWindow {
                name: match id {
                    None => "(context)".to_string(),
                    Some(i) => entries
                        .get(*i)
                        .and_then(|e| e.as_ref())
                        .map_or_else(|| format!("handler{i}"), |e| e.name.clone()),
                },
                ns: *ns,
            })
            .collect();
        *self
            .shared
            .stats
            .windows
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = named;
        self.shared
            .stats
            .window_ns
            .store(window, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
