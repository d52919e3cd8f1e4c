//! Character devices (`--chardev`, `chardev-add`), with QEMU's options and words: what a
//! monitor talks through, a socket (unix `path=`, or TCP `host=`/`port=`) that the daemon
//! listens on with `server=on` or otherwise connects to (the manager listens first, as
//! libvirt-style managers and QEMU's own tests attach) or `stdio`; and the devices without
//! a user that management tools and QEMU's tests make: `ringbuf`/`memory` (read and
//! written with `ringbuf-read`/`-write`), `null` and `file`. [`table`] holds them while
//! the daemon runs.

pub mod log;
pub mod table;

use std::path::PathBuf;

use serde_json::Value;

use crate::cli::keyval::{KeyVal, OptionError};
use log::LogOptions;

/// Where a socket chardev is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketAddr {
    Unix(PathBuf),
    Inet { host: String, port: u16 },
}

/// One character device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chardev {
    /// `server=on`: clients connect to the daemon.
    Listen(SocketAddr),
    /// `server=off` (QEMU's default): the daemon connects at start.
    Connect(SocketAddr),
    /// Standard input and output.
    Stdio,
    /// Discards what it is given, gives nothing.
    Null,
    /// Keeps the last `size` bytes written to it (`memory` is QEMU's other name).
    Ringbuf { size: u64, memory: bool },
    /// Writes what it is given to `out`.
    File { out: PathBuf, append: bool },
}

/// The default size of a ringbuf (QEMU's).
const RINGBUF_SIZE: u64 = 65536;

/// What stord has, as query-chardev-backends lists them.
pub const BACKENDS: &[&str] = &["null", "ringbuf", "socket", "stdio", "memory", "file"];

/// Why a `--chardev` was refused: the cli layer's error, QEMU's texts where it has one.
#[derive(Debug, thiserror::Error)]
pub enum ChardevError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("{0}")]
    Invalid(String),
}

fn invalid(s: impl Into<String>) -> ChardevError {
    ChardevError::Invalid(s.into())
}

impl Chardev {
    /// A `--chardev` option's id, device and log (`backend` is the implied first key).
    pub fn from_options(mut kv: KeyVal) -> Result<(String, Chardev, LogOptions), ChardevError> {
        let backend = kv.take_required("backend")?;
        let log = LogOptions::from_options(&mut kv)?;
        let id = kv
            .take("id")
            .ok_or_else(|| invalid("chardev: no id specified"))?;
        let dev = match backend.as_str() {
            "socket" => socket(&mut kv)?,
            "stdio" => {
                // Whether ^C on a terminal signals the daemon: it does in stord either way.
                kv.take_bool("signal", true)?;
                Chardev::Stdio
            }
            "null" => Chardev::Null,
            "ringbuf" | "memory" => Chardev::Ringbuf {
                size: kv.take_u64("size", false)?.unwrap_or(RINGBUF_SIZE),
                memory: backend == "memory",
            },
            "file" => Chardev::File {
                out: PathBuf::from(kv.take_required("path")?),
                append: kv.take_bool("append", false)?,
            },
            other => return Err(unsupported(other)),
        };
        if kv.take_bool("mux", false)? {
            return Err(invalid("chardev: mux=on is not supported by stord"));
        }
        kv.finish()?;
        Ok((id, dev, log))
    }
}

fn unsupported(backend: &str) -> ChardevError {
    invalid(format!(
        "chardev backend '{backend}' is not supported by stord (it has {})",
        BACKENDS.join(", ")
    ))
}

impl Chardev {
    /// A `chardev-add` backend (QEMU's ChardevBackend: `type` and its `data`).
    pub fn from_qmp(backend: &Value) -> Result<Chardev, ChardevError> {
        let ty = backend.get("type").and_then(Value::as_str).unwrap_or("");
        let data = backend.get("data").cloned().unwrap_or(Value::Null);
        let str_of = |k: &str| data.get(k).and_then(Value::as_str).map(str::to_string);
        let bool_of = |k: &str, d: bool| data.get(k).and_then(Value::as_bool).unwrap_or(d);
        Ok(match ty {
            "null" => Chardev::Null,
            "stdio" => Chardev::Stdio,
            "ringbuf" | "memory" => Chardev::Ringbuf {
                size: data
                    .get("size")
                    .and_then(Value::as_u64)
                    .unwrap_or(RINGBUF_SIZE),
                memory: ty == "memory",
            },
            "file" => Chardev::File {
                out: PathBuf::from(
                    str_of("out")
                        .ok_or_else(|| invalid("Parameter 'backend.data.out' is missing"))?,
                ),
                append: bool_of("append", false),
            },
            "socket" => {
                let addr = data.get("addr").cloned().unwrap_or(Value::Null);
                let a = addr.get("data").cloned().unwrap_or(Value::Null);
                let field = |k: &str| a.get(k).and_then(Value::as_str).map(str::to_string);
                let addr = match addr.get("type").and_then(Value::as_str) {
                    Some("unix") => {
                        SocketAddr::Unix(PathBuf::from(field("path").unwrap_or_default()))
                    }
                    Some("inet") => SocketAddr::Inet {
                        host: field("host").unwrap_or_default(),
                        port: field("port")
                            .and_then(|p| p.parse().ok())
                            .ok_or_else(|| invalid("chardev: socket: no port given"))?,
                    },
                    _ => return Err(invalid("chardev: socket: 'addr' must be unix or inet")),
                };
                if bool_of("server", true) {
                    Chardev::Listen(addr)
                } else {
                    Chardev::Connect(addr)
                }
            }
            other => return Err(unsupported(other)),
        })
    }

    /// QEMU's QOM type name of the device.
    pub fn type_name(&self) -> &'static str {
        match self {
            Chardev::Listen(_) | Chardev::Connect(_) => "chardev-socket",
            Chardev::Stdio => "chardev-stdio",
            Chardev::Null => "chardev-null",
            Chardev::Ringbuf { memory: true, .. } => "chardev-memory",
            Chardev::Ringbuf { .. } => "chardev-ringbuf",
            Chardev::File { .. } => "chardev-file",
        }
    }

    /// What query-chardev calls it (QEMU's chr->filename; a listening socket without a
    /// client is "disconnected:").
    pub fn filename(&self, connected: bool) -> String {
        let socket = |a: &SocketAddr, server: bool| {
            let s = match a {
                SocketAddr::Unix(p) => format!("unix:{}", p.display()),
                SocketAddr::Inet { host, port } => format!("tcp:{host}:{port}"),
            };
            let s = if server { format!("{s},server=on") } else { s };
            if connected {
                s
            } else {
                format!("disconnected:{s}")
            }
        };
        match self {
            Chardev::Listen(a) => socket(a, true),
            Chardev::Connect(a) => socket(a, false),
            Chardev::Stdio => "stdio".into(),
            Chardev::Null => "null".into(),
            Chardev::Ringbuf { memory: true, .. } => "memory".into(),
            Chardev::Ringbuf { .. } => "ringbuf".into(),
            Chardev::File { .. } => "file".into(),
        }
    }
}

/// `socket`: QEMU's qemu_chr_parse_socket, for the options a monitor's socket takes.
fn socket(kv: &mut KeyVal) -> Result<Chardev, ChardevError> {
    let (path, host, port) = (kv.take("path"), kv.take("host"), kv.take("port"));
    if path.is_some() && host.is_some() {
        return Err(invalid(
            "None or one of 'path', 'fd' or 'host' option required.",
        ));
    }
    let addr = match (path, host, port) {
        (Some(p), _, _) => SocketAddr::Unix(PathBuf::from(p)),
        (None, Some(_), None) => return Err(invalid("chardev: socket: no port given")),
        (None, Some(host), Some(port)) => SocketAddr::Inet {
            port: port.parse().map_err(|_| {
                invalid(format!(
                    "Parameter 'port' expects a port number, got '{port}'"
                ))
            })?,
            host,
        },
        (None, None, _) => return Err(invalid("chardev: socket: 'path' or 'host' is needed")),
    };
    let server = kv.take_bool("server", false)?;
    // QEMU waits for the first client of a server unless told not to.
    if server && kv.take_bool("wait", true)? {
        return Err(invalid(
            "chardev: wait=on is not supported by stord (use wait=off)",
        ));
    }
    if !server {
        kv.take_bool("wait", false)?;
    }
    // Options that change nothing for a monitor on loopback or a unix socket.
    for k in ["ipv4", "ipv6", "nodelay", "delay", "tight"] {
        kv.take_bool(k, false)?;
    }
    kv.take_u64("to", false)?;
    for k in ["reconnect", "reconnect-ms"] {
        if kv.take_u64(k, false)?.unwrap_or(0) != 0 {
            return Err(invalid(format!("chardev: '{k}' is not supported by stord")));
        }
    }
    for k in ["telnet", "tn3270", "websocket", "abstract"] {
        if kv.take_bool(k, false)? {
            return Err(invalid(format!("chardev: '{k}' is not supported by stord")));
        }
    }
    if kv.get("tls-creds").is_some() {
        return Err(invalid("chardev: 'tls-creds' is not supported by stord"));
    }
    Ok(if server {
        Chardev::Listen(addr)
    } else {
        Chardev::Connect(addr)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<(String, Chardev), String> {
        let kv = KeyVal::parse("--chardev", s, Some("backend")).map_err(|e| e.to_string())?;
        Chardev::from_options(kv)
            .map(|(id, dev, _)| (id, dev))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn qemus_socket_and_stdio_forms() {
        let unix = SocketAddr::Unix("/tmp/m".into());
        assert_eq!(
            parse("socket,id=m,path=/tmp/m,server=on,wait=off").unwrap(),
            ("m".into(), Chardev::Listen(unix.clone()))
        );
        // No server=on: the daemon connects (iotests' QemuStorageDaemon, managers).
        assert_eq!(
            parse("socket,id=m,path=/tmp/m").unwrap().1,
            Chardev::Connect(unix)
        );
        assert_eq!(
            parse("socket,id=m,host=127.0.0.1,port=4444,server=on,wait=off")
                .unwrap()
                .1,
            Chardev::Listen(SocketAddr::Inet {
                host: "127.0.0.1".into(),
                port: 4444
            })
        );
        assert_eq!(parse("stdio,id=s").unwrap().1, Chardev::Stdio);
        assert_eq!(
            parse("socket,id=m,host=x").unwrap_err(),
            "chardev: socket: no port given"
        );
        assert_eq!(
            parse("socket,path=/x").unwrap_err(),
            "chardev: no id specified"
        );
        assert!(parse("socket,id=m,path=/x,server=on")
            .unwrap_err()
            .contains("wait=on"));
        assert!(parse("vc,id=m").unwrap_err().contains("'vc'"));
    }
}
