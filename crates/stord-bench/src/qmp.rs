//! A minimal QMP client, to read a stord daemon's loop statistics (`query-iothreads`
//! x-stats) before and after a measured run.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

/// A negotiated QMP connection.
pub struct Qmp {
    r: BufReader<UnixStream>,
}

impl Qmp {
    /// Connects to `path` and negotiates capabilities.
    pub fn connect(path: &Path) -> std::io::Result<Qmp> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut q = Qmp {
            r: BufReader::new(s),
        };
        q.line()?;
        q.execute("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn line(&mut self) -> std::io::Result<Value> {
        let mut l = String::new();
        self.r.read_line(&mut l)?;
        serde_json::from_str(&l).map_err(std::io::Error::other)
    }

    /// Runs a command; its `return` value (events are skipped).
    pub fn execute(&mut self, cmd: &str, args: Value) -> std::io::Result<Value> {
        let msg = json!({ "execute": cmd, "arguments": args });
        self.r.get_mut().write_all(format!("{msg}\n").as_bytes())?;
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(std::io::Error::other(e.to_string()));
            }
        }
    }

    /// The x-stats of every IoThread, summed: loop counters and the users' counters, by
    /// name (e.g. `blocking-waits`, `virtqueue.kicks`).
    pub fn loop_counters(&mut self) -> std::io::Result<Vec<(String, u64)>> {
        let threads = self.execute("query-iothreads", json!({}))?;
        let mut out: Vec<(String, u64)> = Vec::new();
        let mut add = |name: &str, v: u64| match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, x)) => *x += v,
            None => out.push((name.to_string(), v)),
        };
        for t in threads.as_array().into_iter().flatten() {
            let st = &t["x-stats"];
            for k in [
                "iterations",
                "polls-attempted",
                "poll-hits",
                "poll-misses",
                "poll-ns",
                "blocked-ns",
                "blocking-waits",
                "eventfd-wakeups",
            ] {
                add(k, st[k].as_u64().unwrap_or(0));
            }
            if let Some(m) = st["counters"].as_object() {
                for (k, v) in m {
                    add(k, v.as_u64().unwrap_or(0));
                }
            }
        }
        Ok(out)
    }
}

impl Qmp {
    /// Every IoThread's histogram `name` (power-of-two buckets), summed.
    pub fn histogram(&mut self, name: &str) -> std::io::Result<Vec<u64>> {
        let threads = self.execute("query-iothreads", json!({}))?;
        let mut sum: Vec<u64> = Vec::new();
        for t in threads.as_array().into_iter().flatten() {
            if let Some(h) = t["x-stats"]["histograms"][name].as_array() {
                sum.resize(sum.len().max(h.len()), 0);
                for (i, v) in h.iter().enumerate() {
                    sum[i] += v.as_u64().unwrap_or(0);
                }
            }
        }
        Ok(sum)
    }
}

/// The median of the values counted between two snapshots of a power-of-two histogram
/// (bucket i > 0 holds [2^(i-1), 2^i)): the geometric middle of the median's bucket.
pub fn histogram_median(before: &[u64], after: &[u64]) -> Option<f64> {
    let d: Vec<u64> = after
        .iter()
        .enumerate()
        .map(|(i, a)| a.saturating_sub(before.get(i).copied().unwrap_or(0)))
        .collect();
    let total: u64 = d.iter().sum();
    if total == 0 {
        return None;
    }
    let mut seen = 0;
    for (i, n) in d.iter().enumerate() {
        seen += n;
        if seen * 2 >= total {
            return Some(if i == 0 {
                0.0
            } else {
                (1u64 << (i - 1)) as f64 * std::f64::consts::SQRT_2
            });
        }
    }
    None
}

/// `after - before` per name, and each divided by `per` (e.g. requests).
pub fn per_unit(before: &[(String, u64)], after: &[(String, u64)], per: &str) -> Value {
    let get = |v: &[(String, u64)], k: &str| v.iter().find(|(n, _)| n == k).map_or(0, |x| x.1);
    let n = (get(after, per) - get(before, per)).max(1) as f64;
    let mut m = serde_json::Map::new();
    m.insert(per.to_string(), json!(n));
    for (k, a) in after {
        if k == per {
            continue;
        }
        let d = a.saturating_sub(get(before, k)) as f64;
        m.insert(
            format!("{k}/{per}"),
            json!((d / n * 1000.0).round() / 1000.0),
        );
    }
    Value::Object(m)
}
