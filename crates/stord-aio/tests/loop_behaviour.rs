//! End-to-end behaviour of the loop, on both reactors: cross-thread wakeups, the notify
//! handshake, poll handlers, timers, bottom halves and IoThread life cycle.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use stord_aio::sys::now_ns;
use stord_aio::{
    AioContext, AioContextOptions, IoThread, PolicyKind, PollHandler, PollParams, ReactorKind,
};

const REACTORS: [ReactorKind; 2] = [ReactorKind::IoUring, ReactorKind::Epoll];

/// These tests measure timing and some busy-poll for long windows; on a 2-core machine
/// they would distort each other, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn opts(name: &str, reactor: ReactorKind, poll: PollParams) -> AioContextOptions {
    AioContextOptions {
        name: name.to_string(),
        reactor,
        poll,
        ..AioContextOptions::default()
    }
}

/// Parameters that make the loop poll for up to a second once the notifier has fired
/// three times with gaps over 4 ms: 0 -> 4 µs -> 4 ms -> 1 s. QEMU's classic policy: these
/// tests are about the loop's mechanics while it polls; the default policy would rightly
/// stop polling for waits this long.
fn long_polling() -> PollParams {
    PollParams {
        policy: PolicyKind::Classic,
        max_ns: 1_000_000_000,
        grow: 1000,
        ..PollParams::default()
    }
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn foreign_work_wakes_an_idle_loop_within_1ms_p99() {
    let _serial = serial();
    for reactor in REACTORS {
        // No timers anywhere: the failure mode is a loop asleep until a timer fires.
        let t = IoThread::spawn(opts("wake", reactor, PollParams::default())).unwrap();
        let remote = t.remote().clone();
        let mut lat = Vec::with_capacity(1000);
        for _ in 0..1000 {
            let done = Arc::new(AtomicU64::new(0));
            let d = done.clone();
            let t0 = now_ns();
            remote.spawn(async move { d.store(now_ns(), Release) });
            // The task stamps the time it ran, so this thread need not spin (which would
            // steal a CPU from the loop on a 2-core machine). The pause also lets the loop
            // go idle again: its poll window is at most 32 µs.
            let start = Instant::now();
            loop {
                std::thread::sleep(Duration::from_micros(300));
                if done.load(Acquire) != 0 {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "task never ran ({reactor})"
                );
            }
            lat.push(done.load(Acquire) - t0);
        }
        lat.sort_unstable();
        let p50 = lat[500];
        let p99 = lat[990];
        eprintln!(
            "{reactor}: p90 {} p95 {} p98 {} max {}",
            lat[900], lat[950], lat[980], lat[999]
        );
        let stats = remote.stats();
        eprintln!(
            "{reactor}: wake p50 {p50} ns p99 {p99} ns, eventfd writes {} avoided {} wakeups {}",
            stats.eventfd_writes, stats.eventfd_writes_avoided, stats.eventfd_wakeups
        );
        assert!(
            p99 < 1_000_000,
            "{reactor}: p99 wake latency {p99} ns >= 1 ms"
        );
        // The loop really slept: the wakeups came through the eventfd.
        assert!(
            stats.eventfd_writes > 0 && stats.eventfd_wakeups > 0,
            "{stats:?}"
        );
    }
}

#[test]
fn no_eventfd_write_while_the_loop_is_polling() {
    let _serial = serial();
    for reactor in REACTORS {
        let t = IoThread::spawn(opts("nowrite", reactor, long_polling())).unwrap();
        let remote = t.remote().clone();
        let ran = Arc::new(AtomicUsize::new(0));
        // Warm up: the notifier's window grows to a second.
        for _ in 0..5 {
            let r = ran.clone();
            remote.spawn(async move {
                r.fetch_add(1, SeqCst);
            });
            std::thread::sleep(Duration::from_millis(6));
        }
        wait_until("warm-up", || ran.load(SeqCst) == 5);
        wait_until("the window to grow", || {
            remote.stats().window_ns >= 1_000_000_000 / 2
        });
        let before = remote.stats();
        for _ in 0..200 {
            let r = ran.clone();
            remote.spawn(async move {
                r.fetch_add(1, SeqCst);
            });
            std::thread::sleep(Duration::from_micros(100));
        }
        wait_until("all tasks", || ran.load(SeqCst) == 205);
        let after = remote.stats();
        assert_eq!(
            after.eventfd_writes, before.eventfd_writes,
            "{reactor}: eventfd written while the loop was polling"
        );
        assert_eq!(
            after.eventfd_writes_avoided - before.eventfd_writes_avoided,
            200
        );
        // Most hand-overs arrive while the loop spins (others while it runs a task).
        assert!(after.poll_hits - before.poll_hits >= 50, "{after:?}");
        assert_eq!(
            after.blocking_waits, before.blocking_waits,
            "{reactor}: the loop blocked"
        );
    }
}

struct FlagHandler {
    flag: Arc<AtomicBool>,
    seen: Arc<AtomicUsize>,
}

impl PollHandler for FlagHandler {
    fn name(&self) -> &str {
        "flag"
    }
    fn poll(&self) -> bool {
        self.flag.load(Acquire)
    }
    fn ready(&self) {
        self.flag.store(false, Release);
        self.seen.fetch_add(1, SeqCst);
    }
}

#[test]
fn a_poll_handler_that_flips_a_flag_is_seen_without_blocking() {
    let _serial = serial();
    for reactor in REACTORS {
        let t = IoThread::spawn(opts("flag", reactor, long_polling())).unwrap();
        let remote = t.remote().clone();
        let flag = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicUsize::new(0));
        let (f, s) = (flag.clone(), seen.clone());
        remote
            .run(move || {
                stord_aio::with_current_context(|ctx| {
                    ctx.add_poll_handler(Rc::new(FlagHandler { flag: f, seen: s }));
                })
            })
            .unwrap()
            .unwrap();
        // Grow the window through the notifier.
        for _ in 0..5 {
            remote.call(|| {});
            std::thread::sleep(Duration::from_millis(6));
        }
        wait_until("the window to grow", || {
            remote.stats().window_ns >= 500_000_000
        });
        let before = remote.stats();
        for i in 1..=50 {
            flag.store(true, Release);
            wait_until("the handler to run", || seen.load(SeqCst) == i);
        }
        let after = remote.stats();
        assert_eq!(
            after.blocking_waits, before.blocking_waits,
            "{reactor}: blocked"
        );
        assert_eq!(after.eventfd_wakeups, before.eventfd_wakeups);
        assert!(after.poll_hits - before.poll_hits >= 50);
        assert!(
            after.windows.iter().any(|w| w.name == "flag"),
            "{:?}",
            after.windows
        );
    }
}

#[test]
fn timers_fire_in_deadline_order_and_not_early() {
    let _serial = serial();
    for reactor in REACTORS {
        let ctx = AioContext::new(opts("timers", reactor, PollParams::default())).unwrap();
        let fired = Rc::new(RefCell::new(Vec::new()));
        let base = now_ns();
        for (ms, tag) in [
            (30u64, "c"),
            (10, "a"),
            (20, "b1"),
            (20, "b2"),
            (5, "first"),
        ] {
            let f = fired.clone();
            let deadline = base + ms * 1_000_000;
            ctx.add_timer(deadline, move || {
                f.borrow_mut().push((tag, now_ns() >= deadline))
            });
        }
        let cancelled = ctx.add_timer(base + 15_000_000, || panic!("cancelled timer fired"));
        assert!(ctx.cancel_timer(cancelled));
        while fired.borrow().len() < 5 {
            ctx.run_once(true);
        }
        let got: Vec<_> = fired.borrow().iter().map(|(t, _)| *t).collect();
        assert_eq!(got, ["first", "a", "b1", "b2", "c"], "{reactor}");
        assert!(
            fired.borrow().iter().all(|(_, on_time)| *on_time),
            "{reactor}: early"
        );
        // A sleeping task wakes at its deadline too.
        let t0 = Instant::now();
        ctx.block_on(stord_aio::sleep(Duration::from_millis(3)));
        assert!(t0.elapsed() >= Duration::from_millis(3));
        drop(ctx);
    }
}

#[test]
fn bottom_halves_run_once_per_schedule() {
    let _serial = serial();
    for reactor in REACTORS {
        let ctx = AioContext::new(opts("bh", reactor, PollParams::default())).unwrap();
        let runs = Rc::new(RefCell::new(0));
        let r = runs.clone();
        let bh = ctx.new_bh(move || *r.borrow_mut() += 1);
        // Two schedules before it runs: one run.
        bh.schedule();
        bh.schedule();
        ctx.run_once(false);
        ctx.run_once(false);
        assert_eq!(*runs.borrow(), 1);
        // Schedule, run, schedule, run: two more.
        bh.schedule();
        ctx.run_once(false);
        bh.schedule();
        ctx.run_once(false);
        assert_eq!(*runs.borrow(), 3);
        // Cancelled before it ran: no run.
        bh.schedule();
        bh.cancel();
        ctx.run_once(false);
        assert_eq!(*runs.borrow(), 3);
        // From another thread, while the loop is not running: two schedules, one run.
        let remote_bh = bh.remote();
        let rb = remote_bh.clone();
        std::thread::spawn(move || {
            rb.schedule();
            rb.schedule();
        })
        .join()
        .unwrap();
        while *runs.borrow() < 4 {
            ctx.run_once(true);
        }
        for _ in 0..3 {
            ctx.run_once(false);
        }
        assert_eq!(*runs.borrow(), 4, "{reactor}");
        // From another thread while the loop blocks: the schedule wakes it.
        let th = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            remote_bh.schedule();
        });
        while *runs.borrow() < 5 {
            ctx.run_once(true);
        }
        th.join().unwrap();
        ctx.run_once(false);
        assert_eq!(*runs.borrow(), 5, "{reactor}");
        // A bottom half may reschedule itself; each schedule is one more run.
        let count = Rc::new(RefCell::new(0));
        let c = count.clone();
        let me: Rc<RefCell<Option<stord_aio::Bh>>> = Rc::default();
        let me2 = me.clone();
        let bh2 = ctx.new_bh(move || {
            *c.borrow_mut() += 1;
            if *c.borrow() < 3 {
                me2.borrow().as_ref().unwrap().schedule();
            }
        });
        bh2.schedule();
        *me.borrow_mut() = Some(bh2);
        for _ in 0..5 {
            ctx.run_once(false);
        }
        assert_eq!(*count.borrow(), 3);
        me.borrow_mut().take();
    }
}

#[test]
fn stopping_an_iothread_joins_it() {
    let _serial = serial();
    for reactor in REACTORS {
        let mut t = IoThread::spawn(opts("stopme", reactor, PollParams::default())).unwrap();
        let remote = t.remote().clone();
        assert!(t.is_running());
        let tid = remote.run(stord_aio::sys::gettid).unwrap();
        assert_eq!(tid, remote.thread_id());
        // A task still pending when the thread stops is dropped with the context.
        struct DropFlag(Arc<AtomicBool>);
        impl Drop for DropFlag {
            fn drop(&mut self) {
                self.0.store(true, SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = DropFlag(dropped.clone());
        remote.spawn(async move {
            let _g = guard;
            std::future::pending::<()>().await;
        });
        t.stop();
        assert!(!t.is_running());
        assert!(remote.is_dead());
        assert!(dropped.load(SeqCst), "pending task was not dropped");
        // After the stop, hand-overs neither run nor hang.
        assert_eq!(remote.run(|| 1), None);
        // The kernel drops the task's /proc entry just after the joiner is released.
        wait_until("the thread's task entry to go", || {
            !std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
        });
    }
}

/// The kernel's view of a thread's slice, as /proc shows it (the default when it has none).
fn proc_slice_ns(tid: i32) -> u64 {
    let sched = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).unwrap();
    let line = sched.lines().find(|l| l.starts_with("se.slice")).unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_loop_thread_asks_for_the_slice_it_was_made_with() {
    let _serial = serial();
    let kernel_default = proc_slice_ns(stord_aio::sys::gettid());
    // The threads below inherit this one's slice: 0 must undo it, not keep it.
    stord_aio::sys::set_sched_slice(500_000).unwrap();
    for (asked, expect) in [
        (None, stord_aio::DEFAULT_SCHED_SLICE_NS),
        (Some(300_000), 300_000),
        (Some(0), 0),
    ] {
        let mut o = opts("slice", ReactorKind::Auto, PollParams::default());
        if let Some(ns) = asked {
            o.sched_slice_ns = ns;
        }
        let t = IoThread::spawn(o).unwrap();
        let remote = t.remote().clone();
        assert_eq!(remote.sched_slice_ns(), expect);
        // What the scheduler runs it with, as the thread and as /proc see it.
        let effective = if expect == 0 { kernel_default } else { expect };
        let own = remote.run(stord_aio::sys::sched_slice).unwrap().unwrap();
        assert_eq!(own, effective, "asked {asked:?}");
        assert_eq!(
            proc_slice_ns(remote.thread_id()),
            effective,
            "asked {asked:?}"
        );
    }
    stord_aio::sys::set_sched_slice(0).unwrap();
    assert_eq!(proc_slice_ns(stord_aio::sys::gettid()), kernel_default);
}

#[test]
fn poll_parameters_change_at_runtime() {
    let _serial = serial();
    for reactor in REACTORS {
        let t = IoThread::spawn(opts("params", reactor, PollParams::default())).unwrap();
        let remote = t.remote().clone();
        let weighted = PollParams {
            policy: PolicyKind::Weighted,
            weight: 2,
            ..PollParams::default()
        };
        remote.set_poll_params(weighted).unwrap();
        assert_eq!(remote.poll_params(), weighted);
        for _ in 0..10 {
            remote.call(|| {});
            std::thread::sleep(Duration::from_micros(20));
        }
        wait_until("the weighted policy", || {
            remote.stats().windows.iter().any(|w| w.name == "(context)")
        });
        let off = PollParams {
            policy: PolicyKind::Off,
            ..PollParams::default()
        };
        remote.set_poll_params(off).unwrap();
        wait_until("policy off", || remote.stats().windows.is_empty());
        let before = remote.stats();
        for _ in 0..20 {
            remote.call(|| {});
            std::thread::sleep(Duration::from_micros(50));
        }
        remote.run(|| ()).unwrap();
        let after = remote.stats();
        assert_eq!(
            after.polls_attempted, before.polls_attempted,
            "{reactor}: polled while off"
        );
        assert_eq!(after.window_ns, 0);
        let bad = PollParams {
            weight: 64,
            ..PollParams::default()
        };
        assert!(remote
            .set_poll_params(bad)
            .unwrap_err()
            .contains("poll-weight"));
    }
}

#[test]
fn reactor_reports_its_kind_and_flags() {
    let _serial = serial();
    let t = IoThread::spawn(opts("uring", ReactorKind::IoUring, PollParams::default())).unwrap();
    let info = t.remote().reactor_info();
    assert_eq!(info.kind, "io_uring");
    // This machine's kernel (6.x) accepts SINGLE_ISSUER and DEFER_TASKRUN.
    assert!(info.flags.contains(&"SINGLE_ISSUER"), "{info:?}");
    assert!(info.flags.contains(&"TASKRUN_FLAG"), "{info:?}");
    let e = IoThread::spawn(opts("epoll", ReactorKind::Epoll, PollParams::default())).unwrap();
    assert_eq!(e.remote().reactor_info().kind, "epoll");
    assert!(e.remote().reactor_info().flags.is_empty());
    // A second context on one thread is refused.
    let err = t
        .remote()
        .run(|| {
            AioContext::new(AioContextOptions::default())
                .err()
                .map(|e| e.kind())
        })
        .unwrap();
    assert_eq!(err, Some(std::io::ErrorKind::AlreadyExists));
}

/// Pins the calling thread to CPU 0.
fn pin_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only
    // touch that local set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    Duration::from_nanos(stord_aio::sys::thread_cpu_ns())
}

/// A loop polling for a long window must not keep a runnable thread on its CPU waiting:
/// with `poll-yield-ns` the busy peer gets most of the shared CPU, without it about half.
#[test]
fn a_polling_loop_lets_a_runnable_thread_on_its_cpu_run() {
    let _serial = serial();
    let peer_share = |yield_ns: u64| -> f64 {
        let params = PollParams {
            yield_ns,
            ..long_polling()
        };
        let t = IoThread::spawn(opts("polite", ReactorKind::IoUring, params)).unwrap();
        let remote = t.remote().clone();
        remote.run(pin_to_cpu0).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        for _ in 0..5 {
            let r = ran.clone();
            remote.spawn(async move {
                r.fetch_add(1, SeqCst);
            });
            std::thread::sleep(Duration::from_millis(6));
        }
        wait_until("the window to grow", || {
            remote.stats().window_ns >= 1_000_000_000 / 2
        });
        // The loop now spins for up to a second; a peer on the same CPU burns 300 ms.
        let peer = std::thread::spawn(|| {
            pin_to_cpu0();
            let (wall, cpu) = (Instant::now(), thread_cpu());
            while thread_cpu() - cpu < Duration::from_millis(300) {
                std::hint::spin_loop();
            }
            0.3 / wall.elapsed().as_secs_f64()
        });
        let share = peer.join().unwrap();
        drop(t);
        share
    };
    let polite = peer_share(stord_aio::poll::DEFAULT_POLL_YIELD_NS);
    let greedy = peer_share(0);
    eprintln!("peer's share of CPU 0: polite {polite:.2}, greedy {greedy:.2}");
    assert!(
        polite > 0.8,
        "the peer got {:.0} % of the CPU",
        polite * 100.0
    );
    assert!(
        greedy < 0.75,
        "without yielding the peer still got {greedy:.2}"
    );
}

/// On io_uring the ring's completions teach two windows: a wait that ends in a storage
/// operation's completion adjusts "io_uring-storage", any other completion "io_uring", and
/// neither touches the other. (A device that sometimes outlasts the window must not cut
/// the window a client's quick turnaround needs.) With poll-max-ns at 1 s, a 2 ms wait
/// grows a window from 0 to 4 µs whatever the machine's timing.
#[test]
fn storage_waits_and_peer_waits_keep_windows_of_their_own() {
    use std::io::Write as _;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use stord_aio::op;

    let _serial = serial();
    let params = PollParams {
        policy: PolicyKind::Classic,
        max_ns: 1_000_000_000,
        ..PollParams::default()
    };
    let ctx = AioContext::new(opts("classes", ReactorKind::IoUring, params)).unwrap();
    let window = |ctx: &AioContext, name: &str| {
        let w = ctx.stats().windows;
        w.iter()
            .find(|w| w.name == name)
            .unwrap_or_else(|| panic!("no window {name} in {w:?}"))
            .ns
    };
    assert_eq!(window(&ctx, "io_uring"), 0);
    assert_eq!(window(&ctx, "io_uring-storage"), 0);

    // One read that completes 2 ms after it is queued, on the ring.
    let read_late = |ctx: &AioContext, storage: bool| {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            tx.write_all(b"x").unwrap();
            tx
        });
        let fd = rx.as_raw_fd();
        let (n, _) = ctx.block_on(async move {
            op::read(fd, vec![0u8; 1], op::CURRENT_POSITION)
                .on_storage_if(storage)
                .await
        });
        assert_eq!(n.unwrap(), 1);
        drop(writer.join().unwrap());
    };

    read_late(&ctx, true);
    assert_eq!(window(&ctx, "io_uring-storage"), 4000);
    assert_eq!(
        window(&ctx, "io_uring"),
        0,
        "a storage wait grew the peers' window"
    );

    // With no storage operation in flight the storage window is not polled: waiting for
    // a timer, the loop goes straight to sleep.
    let before = ctx.stats().polls_attempted;
    ctx.block_on(stord_aio::sleep(Duration::from_millis(1)));
    assert_eq!(
        ctx.stats().polls_attempted,
        before,
        "polled for a storage completion nobody owed"
    );

    read_late(&ctx, false);
    assert_eq!(window(&ctx, "io_uring"), 4000);
    assert_eq!(
        window(&ctx, "io_uring-storage"),
        4000,
        "a peer's wait changed the storage window"
    );
}

/// A completion of the loop's own making (here the cancellation of a dropped storage
/// operation) teaches no window: only the storage operation's own completion counts, and
/// for the storage window.
#[test]
fn a_cancelled_storage_operation_does_not_teach_the_peers_window() {
    use std::future::Future as _;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::task::Poll;
    use stord_aio::op;

    let _serial = serial();
    let params = PollParams {
        policy: PolicyKind::Classic,
        max_ns: 1_000_000_000,
        ..PollParams::default()
    };
    let ctx = AioContext::new(opts("cancel", ReactorKind::IoUring, params)).unwrap();
    let (_tx, rx) = UnixStream::pair().unwrap();
    let fd = rx.as_raw_fd();
    ctx.block_on(async move {
        // Nothing is ever written: the read stays in flight until it is dropped.
        let mut read = Box::pin(op::read(fd, vec![0u8; 1], op::CURRENT_POSITION).on_storage());
        std::future::poll_fn(|cx| {
            assert!(read.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        stord_aio::sleep(Duration::from_millis(2)).await;
        drop(read);
        // The cancellation and the read's -ECANCELED arrive during this wait.
        stord_aio::sleep(Duration::from_millis(2)).await;
    });
    let w = ctx.stats().windows;
    let ns = |name: &str| w.iter().find(|x| x.name == name).map(|x| x.ns);
    assert_eq!(ns("io_uring-storage"), Some(4000), "{w:?}");
    assert_eq!(
        ns("io_uring"),
        Some(0),
        "a cancellation taught the peers' window: {w:?}"
    );
}

/// A loop that is going to sleep submits what it queued in the same io_uring_enter that
/// waits: one system call per request at queue depth 1, not a submit and then a wait.
#[test]
fn a_sleeping_loop_submits_and_waits_in_one_enter() {
    use stord_aio::op;

    let _serial = serial();
    let params = PollParams {
        policy: PolicyKind::Off,
        ..PollParams::default()
    };
    let ctx = AioContext::new(opts("enters", ReactorKind::IoUring, params)).unwrap();
    const N: u64 = 200;
    let before = ctx.stats().ring_enters;
    ctx.block_on(async {
        for _ in 0..N {
            op::timeout(Duration::from_micros(50)).await.unwrap();
        }
    });
    let enters = ctx.stats().ring_enters - before;
    assert!(enters >= N, "{enters} enters for {N} waits: not counted");
    assert!(
        enters <= N + N / 10,
        "{enters} io_uring_enter calls for {N} waits on queued operations"
    );
}
