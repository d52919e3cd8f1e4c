//! A raw QMP connection for tests that misbehave on purpose or just need one number
//! (the qemu.qmp library drives the well-behaved QMP tests).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A negotiated QMP connection.
pub struct RawQmp {
    pub r: BufReader<UnixStream>,
    /// Events read while waiting for replies, oldest first.
    pub events: Vec<serde_json::Value>,
}

impl RawQmp {
    /// Connects, reads the greeting and negotiates capabilities.
    pub fn connect(path: &Path) -> RawQmp {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut q = RawQmp {
            r: BufReader::new(s),
            events: Vec::new(),
        };
        let greeting = q.line();
        assert!(greeting.get("QMP").is_some(), "{greeting}");
        let r = q.send("{\"execute\":\"qmp_capabilities\"}");
        assert!(r.get("return").is_some(), "{r}");
        q
    }

    /// The next message.
    pub fn line(&mut self) -> serde_json::Value {
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    /// Sends `text` (one JSON message) and returns the reply (events skipped).
    pub fn send(&mut self, text: &str) -> serde_json::Value {
        // One write: qsd acts on a command at its closing brace, and a quit closes the
        // socket before a second write of the newline could land.
        self.r
            .get_mut()
            .write_all(format!("{text}\n").as_bytes())
            .unwrap();
        loop {
            let v = self.line();
            if v.get("event").is_none() {
                return v;
            }
            self.events.push(v);
        }
    }

    /// Waits for the event `name` whose data has `key` = `value` (or takes it from those
    /// already read).
    pub fn wait_event(&mut self, name: &str, key: &str, value: &str) -> serde_json::Value {
        let hit = |v: &serde_json::Value| v["event"] == name && v["data"][key] == value;
        if let Some(i) = self.events.iter().position(hit) {
            return self.events.remove(i);
        }
        loop {
            let v = self.line();
            if hit(&v) {
                return v;
            }
            self.events.push(v);
        }
    }

    /// The named counter summed over every IoThread's x-stats.
    pub fn counter(&mut self, name: &str) -> u64 {
        let r = self.send("{\"execute\":\"query-iothreads\"}");
        r["return"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["x-stats"]["counters"][name].as_u64().unwrap_or(0))
            .sum()
    }

    /// Requests served per queue of vhost-user-blk export `id` (query-block-exports).
    pub fn queue_requests(&mut self, id: &str) -> Vec<u64> {
        let r = self.send(r#"{"execute":"query-block-exports"}"#);
        let e = r["return"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["id"] == id)
            .unwrap_or_else(|| panic!("no export {id} in {r}"))
            .clone();
        e["x-queue-requests"]
            .as_array()
            .unwrap_or_else(|| panic!("no x-queue-requests in {e}"))
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect()
    }
}

/// `--chardev` and `--monitor` arguments for a QMP monitor on `path`.
pub fn monitor_args(path: &Path) -> Vec<String> {
    vec![
        "--chardev".into(),
        format!("socket,id=m,path={},server=on,wait=off", path.display()),
        "--monitor".into(),
        "chardev=m".into(),
    ]
}
