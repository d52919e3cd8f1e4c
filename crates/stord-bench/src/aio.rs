//! `stord-bench aio`: round trips between a client thread and an IoThread through
//! `Remote`, for each polling policy and a few think times.
//!
//! The client stamps the time, spawns a task on the loop through its `Remote`, and waits
//! (spinning) for the task to store its reply; then it "thinks" for a while (spinning for
//! short think times, sleeping for 1 ms) so the loop goes idle in between. We report the
//! median and p99 round trip, the loop thread's CPU time per second of wall time (from
//! /proc/self/task/TID/schedstat) and what the loop's statistics say happened: how often
//! polling caught the hand-over, and how many eventfd writes each round trip cost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use stord_aio::sys::{now_ns, task_cpu_ns};
use stord_aio::{AioContextOptions, IoThread, PolicyKind, PollParams, ReactorKind};

/// One (policy, think time) case.
#[derive(Debug, Serialize)]
pub struct AioCase {
    pub reactor: String,
    pub policy: String,
    pub think_us: u64,
    pub round_trips: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub loop_cpu_ms_per_s: f64,
    pub poll_hit_rate: f64,
    pub eventfd_writes_per_rt: f64,
    pub blocking_waits_per_rt: f64,
    pub final_window_ns: u64,
}

/// Options of the aio benchmark.
pub struct AioOptions {
    pub duration: Duration,
    pub reactor: ReactorKind,
    pub policies: Vec<PolicyKind>,
    pub think_us: Vec<u64>,
}

impl Default for AioOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_millis(1500),
            reactor: ReactorKind::IoUring,
            policies: PolicyKind::ALL.to_vec(),
            think_us: vec![0, 10, 100, 1000],
        }
    }
}

fn think(us: u64) {
    if us == 0 {
        return;
    }
    if us >= 1000 {
        std::thread::sleep(Duration::from_micros(us));
        return;
    }
    let until = now_ns() + us * 1000;
    while now_ns() < until {
        std::hint::spin_loop();
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx] as f64 / 1000.0
}

/// Runs one case.
pub fn run_case(
    reactor: ReactorKind,
    policy: PolicyKind,
    think_us: u64,
    duration: Duration,
) -> AioCase {
    let poll = PollParams {
        policy,
        ..PollParams::default()
    };
    let t = IoThread::spawn(AioContextOptions {
        name: format!("bench-{policy}"),
        reactor,
        poll,
        ..AioContextOptions::default()
    })
    .expect("start iothread");
    let remote = t.remote().clone();
    let tid = remote.thread_id();
    // Warm-up: let the policy settle.
    let reply = Arc::new(AtomicU64::new(0));
    let round_trip = |reply: &Arc<AtomicU64>| -> u64 {
        reply.store(0, Ordering::Relaxed);
        let r = reply.clone();
        let t0 = now_ns();
        remote.spawn(async move { r.store(1, Ordering::Release) });
        while reply.load(Ordering::Acquire) == 0 {
            std::hint::spin_loop();
        }
        now_ns() - t0
    };
    let warm_until = Instant::now() + duration / 5;
    while Instant::now() < warm_until {
        round_trip(&reply);
        think(think_us);
    }
    let s0 = remote.stats();
    let cpu0 = task_cpu_ns(tid).unwrap_or(0);
    let start = Instant::now();
    let mut lat = Vec::with_capacity(200_000);
    while start.elapsed() < duration {
        lat.push(round_trip(&reply));
        think(think_us);
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu1 = task_cpu_ns(tid).unwrap_or(0);
    let s1 = remote.stats();
    drop(t);
    lat.sort_unstable();
    let n = lat.len() as f64;
    let polls = (s1.poll_hits - s0.poll_hits) + (s1.poll_misses - s0.poll_misses);
    AioCase {
        reactor: remote.reactor_info().kind.to_string(),
        policy: policy.name().to_string(),
        think_us,
        round_trips: lat.len() as u64,
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        mean_us: lat.iter().sum::<u64>() as f64 / n / 1000.0,
        loop_cpu_ms_per_s: (cpu1 - cpu0) as f64 / 1e6 / wall,
        poll_hit_rate: if polls == 0 {
            0.0
        } else {
            (s1.poll_hits - s0.poll_hits) as f64 / polls as f64
        },
        eventfd_writes_per_rt: (s1.eventfd_writes - s0.eventfd_writes) as f64 / n,
        blocking_waits_per_rt: (s1.blocking_waits - s0.blocking_waits) as f64 / n,
        final_window_ns: s1.window_ns,
    }
}

/// Runs the matrix, printing a table as it goes.
pub fn run(opts: &AioOptions) -> Vec<AioCase> {
    println!(
        "{:<8} {:<9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>12} {:>8} {:>9} {:>9}",
        "reactor",
        "policy",
        "think",
        "trips",
        "p50 µs",
        "p99 µs",
        "mean µs",
        "loop CPU ms/s",
        "hit %",
        "efd w/rt",
        "window"
    );
    let mut out = Vec::new();
    for &think_us in &opts.think_us {
        for &policy in &opts.policies {
            let c = run_case(opts.reactor, policy, think_us, opts.duration);
            println!(
                "{:<8} {:<9} {:>4}µs {:>9} {:>9.1} {:>9.1} {:>9.1} {:>13.1} {:>8.1} {:>9.3} {:>9}",
                c.reactor,
                c.policy,
                c.think_us,
                c.round_trips,
                c.p50_us,
                c.p99_us,
                c.mean_us,
                c.loop_cpu_ms_per_s,
                c.poll_hit_rate * 100.0,
                c.eventfd_writes_per_rt,
                c.final_window_ns
            );
            out.push(c);
        }
    }
    out
}
