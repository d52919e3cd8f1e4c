//! The OpenMetrics listener, stord's own (`--object metrics,id=ID,addr.type=unix,
//! addr.path=P` or `addr.type=inet,addr.host=H,addr.port=N`; off unless an object asks
//! for it): Prometheus scrapes every node's query-blockstats counters over HTTP, no QMP
//! client needed. Each connection gets one response to one GET and is closed; the main
//! loop serves it. A client gets 5 s and 8 KiB for its request, and at most 16 are
//! served at once: a scraper cannot make the daemon hold more.

use std::cell::Cell;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use serde_json::Value;
use stord_aio::{op, AioContext, Interest, Slice};

use crate::accept::Acceptor;
use crate::export::nbd::options::ListenAddr;

/// How long a client has to send its request.
const REQUEST_TIME: Duration = Duration::from_secs(5);
/// The most a request's head may take.
const MAX_REQUEST: usize = 8 << 10;
/// Connections served at once.
const MAX_CLIENTS: usize = 16;

/// What a scrape reads: every node's name and query-blockstats counters.
pub type Source = Rc<dyn Fn() -> Vec<(String, Value)>>;

/// A listening metrics endpoint; stops (and removes its unix socket) when dropped.
pub struct MetricsServer {
    _acceptor: Acceptor,
    path: Option<PathBuf>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl MetricsServer {
    /// Listens on `addr` from `ctx` (the main loop).
    pub fn start(ctx: &AioContext, addr: &ListenAddr, source: Source) -> std::io::Result<Self> {
        let (fd, path): (OwnedFd, _) = match addr {
            ListenAddr::Unix(p) => {
                let _ = std::fs::remove_file(p);
                let l = std::os::unix::net::UnixListener::bind(p)?;
                l.set_nonblocking(true)?;
                (l.into(), Some(p.clone()))
            }
            ListenAddr::Inet(h, port) => {
                let l = std::net::TcpListener::bind((h.as_str(), *port))?;
                l.set_nonblocking(true)?;
                (l.into(), None)
            }
        };
        let live = Rc::new(Cell::new(0usize));
        let acceptor = Acceptor::start(ctx, "metrics", fd, move |conn| {
            if live.get() >= MAX_CLIENTS {
                return;
            }
            live.set(live.get() + 1);
            let (live, source) = (live.clone(), source.clone());
            stord_aio::spawn_detached(async move {
                serve(conn, &source).await;
                live.set(live.get() - 1);
            });
        })?;
        Ok(MetricsServer {
            _acceptor: acceptor,
            path,
        })
    }
}

/// Reads the request's head (None: the client went, took too long or sent too much).
async fn read_head(fd: RawFd) -> Option<Vec<u8>> {
    let read = async {
        let mut head = Vec::new();
        let mut buf = vec![0u8; 2048];
        loop {
            let n = buf.len();
            let (r, s) = op::recv(fd, Slice::new(buf, 0, n), 0).await;
            buf = s.into_inner();
            match r {
                Ok(0) => return None,
                Ok(k) => {
                    head.extend_from_slice(&buf[..k]);
                    if head.windows(4).any(|w| w == b"\r\n\r\n") {
                        return Some(head);
                    }
                    if head.len() > MAX_REQUEST {
                        return None;
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if op::poll_add(fd, Interest::READABLE).await.is_err() {
                        return None;
                    }
                }
                Err(_) => return None,
            }
        }
    };
    let mut read = std::pin::pin!(read);
    let mut timer = std::pin::pin!(stord_aio::sleep(REQUEST_TIME));
    std::future::poll_fn(|cx| {
        use std::future::Future;
        use std::task::Poll;
        if let Poll::Ready(head) = read.as_mut().poll(cx) {
            return Poll::Ready(head);
        }
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

async fn send_all(fd: RawFd, data: Vec<u8>) {
    let mut off = 0;
    let mut data = data;
    while off < data.len() {
        let n = data.len() - off;
        let (r, s) = op::send(fd, Slice::new(data, off, n), 0).await;
        data = s.into_inner();
        match r {
            Ok(0) => return,
            Ok(k) => off += k,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                if op::poll_add(fd, Interest::WRITABLE).await.is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

async fn serve(conn: OwnedFd, source: &Source) {
    let fd = conn.as_raw_fd();
    let Some(head) = read_head(fd).await else {
        // Shutting the socket ends a receive still queued on it.
        crate::sys::shutdown(fd);
        return;
    };
    let response = if head.starts_with(b"GET ") {
        let body = render(&source());
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; \
             charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
            .to_string()
    };
    send_all(fd, response.into_bytes()).await;
    crate::sys::shutdown(fd);
}

/// A label value as OpenMetrics quotes it.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The kinds of request, with QEMU's prefixes in query-blockstats.
const OPS: [(&str, &str); 4] = [
    ("read", "rd"),
    ("write", "wr"),
    ("flush", "flush"),
    ("discard", "unmap"),
];

/// The families: name, type, unit, help, and each sample's value from one node's
/// query-blockstats fields and a kind (None: not per kind; a None value: no sample).
type Family = (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
    fn(&Value, Option<(&str, &str)>) -> Option<String>,
);

fn field(s: &Value, f: &str) -> u64 {
    s.get(f).and_then(Value::as_u64).unwrap_or(0)
}

const FAMILIES: &[Family] = &[
    (
        "stord_node_operations",
        "counter",
        None,
        "Requests a node served, by kind (query-blockstats' *_operations).",
        |s, k| Some(field(s, &format!("{}_operations", k?.1)).to_string()),
    ),
    (
        "stord_node_bytes",
        "counter",
        Some("bytes"),
        "Bytes a node read, wrote or discarded.",
        |s, k| {
            let (op, q) = k?;
            (op != "flush").then(|| field(s, &format!("{q}_bytes")).to_string())
        },
    ),
    (
        "stord_node_failed_operations",
        "counter",
        None,
        "Requests that failed.",
        |s, k| Some(field(s, &format!("failed_{}_operations", k?.1)).to_string()),
    ),
    (
        "stord_node_invalid_operations",
        "counter",
        None,
        "Requests refused as invalid (out of range).",
        |s, k| Some(field(s, &format!("invalid_{}_operations", k?.1)).to_string()),
    ),
    (
        "stord_node_time_seconds",
        "counter",
        Some("seconds"),
        "Time the node's requests took, summed.",
        |s, k| {
            let ns = field(s, &format!("{}_total_time_ns", k?.1));
            Some(format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000))
        },
    ),
    (
        "stord_node_write_highest_offset_bytes",
        "gauge",
        Some("bytes"),
        "The highest offset a write reached.",
        |s, k| {
            k.is_none()
                .then(|| field(s, "wr_highest_offset").to_string())
        },
    ),
];

/// The families, from each node's query-blockstats fields.
pub fn render(nodes: &[(String, Value)]) -> String {
    let mut out = String::new();
    for &(name, kind, unit, help, value) in FAMILIES {
        out.push_str(&format!("# TYPE {name} {kind}\n"));
        if let Some(u) = unit {
            out.push_str(&format!("# UNIT {name} {u}\n"));
        }
        out.push_str(&format!("# HELP {name} {help}\n"));
        let sample = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_string()
        };
        for (node, s) in nodes {
            let n = label(node);
            if let Some(v) = value(s, None) {
                out.push_str(&format!("{sample}{{node=\"{n}\"}} {v}\n"));
            }
            for k in OPS {
                if let Some(v) = value(s, Some(k)) {
                    out.push_str(&format!("{sample}{{node=\"{n}\",op=\"{}\"}} {v}\n", k.0));
                }
            }
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_carry_each_node_and_end_with_eof() {
        let s = serde_json::json!({
            "rd_operations": 3, "rd_bytes": 12288, "wr_operations": 1, "wr_bytes": 512,
            "rd_total_time_ns": 1_500_000_000u64, "wr_highest_offset": 4096,
        });
        let text = render(&[("di\"sk".into(), s)]);
        assert!(text.contains("stord_node_operations_total{node=\"di\\\"sk\",op=\"read\"} 3\n"));
        assert!(text.contains("stord_node_bytes_total{node=\"di\\\"sk\",op=\"write\"} 512\n"));
        assert!(!text.contains("op=\"flush\"} 0\nstord_node_bytes"));
        assert!(text.contains(
            "stord_node_time_seconds_total{node=\"di\\\"sk\",op=\"read\"} 1.500000000\n"
        ));
        assert!(text.contains("stord_node_write_highest_offset_bytes{node=\"di\\\"sk\"} 4096\n"));
        assert!(text.ends_with("# EOF\n"));
    }
}
