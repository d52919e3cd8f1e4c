//! stord-bench: benchmarks that print figures and write them to JSON under `results/`.
//!
//! Subcommands:
//! - `aio [--duration-ms N] [--reactor io_uring|epoll] [--policy P]... [--think-us N]...`:
//!   Remote round trips into an IoThread per polling policy and think time.
//! - `nbd [--runtime S] [--reps N] [--backend null|file]... [--daemon stord|qsd|nbdkit]...
//!   [--workload randread:16]... [--stord-policy P] [--file-aio MODE]`: fio's nbd engine
//!   against stord, qemu-storage-daemon and nbdkit, with fio on the raw file as the floor.
//! - `idle [--seconds N]`: CPU used by each daemon with two IoThreads and an export, idle.
//! - `fuse [--runtime S] [--reps N] [--backend null|file]... [--iothreads N]...
//!   [--daemon stord|qsd]...`: fio through the FUSE-mounted image, stord vs qsd.

mod aio;
mod fuse;
mod idle;
mod nbd;
mod peers;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn usage() -> ! {
    eprintln!(
        "usage: stord-bench aio [--duration-ms N] [--reactor io_uring|epoll] \
         [--policy off|classic|weighted|haltpoll]... [--think-us N]... [--out DIR]\n\
         \x20      stord-bench nbd [--runtime S] [--reps N] [--backend null|file]... \
         [--daemon stord|qsd|nbdkit]... [--workload RW:QD]... [--stord-policy P] [--file-aio MODE] [--out DIR]"
    );
    std::process::exit(2);
}

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> &'a str {
    *i += 1;
    args.get(*i).map(String::as_str).unwrap_or_else(|| {
        eprintln!("stord-bench: {flag} needs a value");
        usage()
    })
}

fn parse<T: std::str::FromStr>(flag: &str, v: &str) -> T
where
    T::Err: std::fmt::Display,
{
    v.parse().unwrap_or_else(|e| {
        eprintln!("stord-bench: bad value '{v}' for {flag}: {e}");
        std::process::exit(2)
    })
}

/// The repo's `results/` folder (or `--out`).
fn results_dir(out: Option<PathBuf>) -> PathBuf {
    out.unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../results"))
}

/// Prints the table and writes `results/<kind>/<time>.{json,md}`.
fn write_rows(
    out: Option<PathBuf>,
    kind: &str,
    name: &str,
    rows: &[nbd::Row],
    extra: serde_json::Value,
) {
    let table = nbd::markdown(rows);
    println!("{table}");
    let dir = results_dir(out).join(kind);
    std::fs::create_dir_all(&dir).expect("create results dir");
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut doc = serde_json::json!({ "benchmark": name, "unix_time": ts, "rows": rows });
    if let (Some(d), serde_json::Value::Object(e)) = (doc.as_object_mut(), extra) {
        d.extend(e);
    }
    std::fs::write(
        dir.join(format!("{ts}.json")),
        serde_json::to_string_pretty(&doc).unwrap(),
    )
    .expect("write results");
    std::fs::write(dir.join(format!("{ts}.md")), &table).expect("write results");
    println!("results: {}", dir.join(format!("{ts}.json")).display());
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("aio") => {
            let mut opts = aio::AioOptions::default();
            let (mut policies, mut thinks, mut out) = (Vec::new(), Vec::new(), None);
            let mut i = 1;
            while i < args.len() {
                let flag = args[i].as_str();
                match flag {
                    "--duration-ms" => {
                        opts.duration =
                            Duration::from_millis(parse(flag, value(&args, &mut i, flag)))
                    }
                    "--reactor" => opts.reactor = parse(flag, value(&args, &mut i, flag)),
                    "--policy" => policies.push(parse(flag, value(&args, &mut i, flag))),
                    "--think-us" => thinks.push(parse(flag, value(&args, &mut i, flag))),
                    "--out" => out = Some(PathBuf::from(value(&args, &mut i, flag))),
                    _ => usage(),
                }
                i += 1;
            }
            if !policies.is_empty() {
                opts.policies = policies;
            }
            if !thinks.is_empty() {
                opts.think_us = thinks;
            }
            let cases = aio::run(&opts);
            let dir = results_dir(out).join("aio");
            std::fs::create_dir_all(&dir).expect("create results dir");
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let path = dir.join(format!("{ts}.json"));
            let doc = serde_json::json!({
                "benchmark": "aio-remote-round-trip",
                "unix_time": ts,
                "duration_ms": opts.duration.as_millis() as u64,
                "cases": cases,
            });
            std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap())
                .expect("write results");
            println!("results: {}", path.display());
        }
        Some("nbd") => {
            let mut opts = nbd::NbdOptions::default();
            let (mut backends, mut daemons, mut workloads, mut out) =
                (Vec::new(), Vec::new(), Vec::new(), None);
            let mut i = 1;
            while i < args.len() {
                let flag = args[i].as_str();
                match flag {
                    "--runtime" => opts.runtime_s = parse(flag, value(&args, &mut i, flag)),
                    "--reps" => opts.reps = parse(flag, value(&args, &mut i, flag)),
                    "--backend" => backends.push(value(&args, &mut i, flag).to_string()),
                    "--daemon" => daemons.push(value(&args, &mut i, flag).to_string()),
                    "--workload" => {
                        let v = value(&args, &mut i, flag);
                        let (rw, qd) = v.split_once(':').unwrap_or_else(|| usage());
                        workloads.push((rw.to_string(), parse(flag, qd)));
                    }
                    "--stord-policy" => opts.stord_policy = value(&args, &mut i, flag).to_string(),
                    "--file-aio" => opts.file_aio = value(&args, &mut i, flag).to_string(),
                    "--out" => out = Some(PathBuf::from(value(&args, &mut i, flag))),
                    _ => usage(),
                }
                i += 1;
            }
            if !backends.is_empty() {
                opts.backends = backends;
            }
            if !daemons.is_empty() {
                opts.daemons = daemons;
            }
            if !workloads.is_empty() {
                opts.workloads = workloads;
            }
            let rows = nbd::run(&opts);
            let extra = serde_json::json!({
                "runtime_s": opts.runtime_s,
                "reps": opts.reps,
                "stord_policy": opts.stord_policy,
                "file_aio": opts.file_aio,
            });
            write_rows(out, "nbd", "nbd-fio", &rows, extra);
        }
        Some("fuse") => {
            let mut opts = fuse::FuseOptions::default();
            let (mut backends, mut daemons, mut threads, mut out) =
                (Vec::new(), Vec::new(), Vec::new(), None);
            let mut i = 1;
            while i < args.len() {
                let flag = args[i].as_str();
                match flag {
                    "--runtime" => opts.runtime_s = parse(flag, value(&args, &mut i, flag)),
                    "--reps" => opts.reps = parse(flag, value(&args, &mut i, flag)),
                    "--backend" => backends.push(value(&args, &mut i, flag).to_string()),
                    "--daemon" => daemons.push(value(&args, &mut i, flag).to_string()),
                    "--iothreads" => threads.push(parse(flag, value(&args, &mut i, flag))),
                    "--out" => out = Some(PathBuf::from(value(&args, &mut i, flag))),
                    _ => usage(),
                }
                i += 1;
            }
            if !backends.is_empty() {
                opts.backends = backends;
            }
            if !daemons.is_empty() {
                opts.daemons = daemons;
            }
            if !threads.is_empty() {
                opts.iothreads = threads;
            }
            let rows = fuse::run(&opts);
            let extra = serde_json::json!({ "runtime_s": opts.runtime_s, "reps": opts.reps });
            write_rows(out, "fuse", "fuse-fio", &rows, extra);
        }
        Some("idle") => {
            let secs = match args.get(1).map(String::as_str) {
                Some("--seconds") => parse(
                    "--seconds",
                    args.get(2).map(String::as_str).unwrap_or_else(|| usage()),
                ),
                _ => 10,
            };
            let rows = idle::run(secs);
            let dir = results_dir(None).join("idle");
            std::fs::create_dir_all(&dir).expect("create results dir");
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let doc =
                serde_json::json!({ "benchmark": "idle-cost", "unix_time": ts, "rows": rows });
            std::fs::write(
                dir.join(format!("{ts}.json")),
                serde_json::to_string_pretty(&doc).unwrap(),
            )
            .expect("write results");
            println!("results: {}", dir.join(format!("{ts}.json")).display());
        }
        _ => usage(),
    }
}
