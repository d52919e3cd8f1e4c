//! One iteration of the loop (QEMU's `aio_poll`, [`AioContext::run_once`]), read as its
//! named steps: each a method of the context's loop-thread half (`Inner`), in order, handing
//! on an `Iteration` that carries the step's results:
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

use crate::context::{Inner, UserHandlers, NOTIFIER_ID, REACTOR_ID, STORAGE_ID};
use crate::handler::{PollSource, Readiness};
use crate::poll::{HandlerId, Observation};
use crate::reactor::{Event, Reactor, Reaped};
use crate::remote::RemoteMsg;
use crate::stats::{AioStats, HandlerWindow};
use crate::sys::now_ns;

/// What one loop iteration hands from step to step (the module's doc numbers them).
struct Iteration {
    /// When it started.
    start: u64,
    /// The latest clock reading: the start, or the end of the spin. The wait's start is
    /// taken from it rather than read again (a clock read costs about as much as a peek
    /// at every handler, and a light loop reads it per request).
    now: u64,
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

impl Inner {
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
    pub(crate) fn run_once(&self, blocking: bool) -> bool {
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
            now: start,
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
        it.now = now;
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
            let t0 = it.now;
            it.reaped = self.reactor.borrow_mut().wait(it.timeout, &mut it.events);
            let t1 = now_ns();
            self.shared.notifier.finish_block();
            it.slept_ns = Some(t1 - t0);
            AioStats::add(&stats.blocked_ns, t1 - t0);
            AioStats::add(&stats.blocking_waits, 1);
            it.now = t1;
        } else {
            self.shared.notifier.finish_block();
            let mut reactor = self.reactor.borrow_mut();
            if reactor.need_wait() {
                it.reaped = it.reaped.merge(reactor.wait(Some(0), &mut it.events));
            }
            it.now = now_ns();
        }
        it.block_ns = it.now - it.start;
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
        // No timer, no clock read.
        if self.timers.borrow_mut().next_deadline().is_none() {
            return 0;
        }
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
    pub(crate) fn publish_windows(&self) {
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

/// Merges events of the same fd handler (OR of their readiness bits), keeping the order of
/// first appearance.
pub(crate) fn merge_fd_events(events: &mut Vec<Event>) {
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
