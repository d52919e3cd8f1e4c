//! `--chardev`: the character devices a monitor talks through, with QEMU's options and
//! words, for what a storage daemon's monitor uses: a socket (unix `path=`, or TCP
//! `host=`/`port=`) that the daemon listens on with `server=on` or otherwise connects to
//! (the manager listens first, as libvirt-style managers and QEMU's own tests attach), and
//! `stdio` (QMP over the daemon's standard input and output).

use std::path::PathBuf;

use crate::cli::keyval::{KeyVal, OptionError};

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
}

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
    /// A `--chardev` option's id and device (`backend` is the implied first key).
    pub fn from_options(mut kv: KeyVal) -> Result<(String, Chardev), ChardevError> {
        let backend = kv.take_required("backend")?;
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
            other => {
                return Err(invalid(format!(
                    "chardev backend '{other}' is not supported by stord (it has socket and stdio)"
                )))
            }
        };
        if kv.take_bool("mux", false)? {
            return Err(invalid("chardev: mux=on is not supported by stord"));
        }
        kv.finish()?;
        Ok((id, dev))
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
        Chardev::from_options(kv).map_err(|e| e.to_string())
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
