//! stord-bench: benchmarks that print figures and write them to JSON under `results/`.
//!
//! Subcommands:
//! - `aio [--duration-ms N] [--reactor io_uring|epoll] [--policy P]... [--think-us N]...`:
//!   Remote round trips into an IoThread per polling policy and think time.

mod aio;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn usage() -> ! {
    eprintln!(
        "usage: stord-bench aio [--duration-ms N] [--reactor io_uring|epoll] \
         [--policy off|classic|weighted|haltpoll]... [--think-us N]... [--out DIR]"
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
        _ => usage(),
    }
}
