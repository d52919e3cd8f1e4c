//! The chardevs the daemon has, by id: those monitors talk through (their user), and those
//! without a user, opened here: a ringbuf's bytes, a file, a socket bound or connected.
//! QEMU's rules and words for adding, changing and removing them (chardev-add,
//! chardev-change, chardev-remove) and for ringbuf-read/-write.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::log::SharedLog;
use super::{Chardev, ChardevError, SocketAddr};

fn invalid(s: impl Into<String>) -> ChardevError {
    ChardevError::Invalid(s.into())
}

/// Chardevs the daemon keeps at most (a client must not make it hold without bound).
pub const MAX_CHARDEVS: usize = 1024;
/// The largest ringbuf (its bytes are held once written).
pub const MAX_RINGBUF: u64 = 64 << 20;

/// A ringbuf's bytes: the last `cap` written.
#[derive(Debug)]
pub struct RingBuf {
    cap: usize,
    bytes: VecDeque<u8>,
}

impl RingBuf {
    /// Appends `data`, the oldest bytes going once it is full.
    pub fn write(&mut self, data: &[u8]) {
        for &b in data {
            if self.bytes.len() == self.cap {
                self.bytes.pop_front();
            }
            self.bytes.push_back(b);
        }
    }

    /// Takes up to `n` of the oldest bytes.
    pub fn read(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.bytes.len());
        self.bytes.drain(..n).collect()
    }
}

/// What an unused chardev holds open.
#[derive(Debug)]
enum Open {
    /// Not opened yet (a `--chardev` a monitor may still take).
    Pending,
    Nothing,
    Ringbuf(RingBuf),
    File(#[allow(dead_code)] std::fs::File),
    /// A socket bound (a unix one's path, removed when it goes) or connected.
    Socket {
        _fd: OwnedFd,
        path: Option<PathBuf>,
    },
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Open::Socket { path: Some(p), .. } = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[derive(Debug)]
struct Entry {
    dev: Chardev,
    /// A monitor talks through it.
    used: bool,
    open: Open,
    /// `logfile`: what it sends is written there too.
    log: Option<SharedLog>,
}

/// The chardevs.
#[derive(Debug, Default)]
pub struct Table {
    entries: BTreeMap<String, Entry>,
}

/// Opens what `dev` needs while nobody uses it.
fn open(dev: &Chardev) -> Result<Open, ChardevError> {
    Ok(match dev {
        Chardev::Null | Chardev::Stdio => Open::Nothing,
        Chardev::Ringbuf { size, .. } => {
            if *size == 0 || !size.is_power_of_two() {
                return Err(invalid("size of ringbuf chardev must be power of two"));
            }
            if *size > MAX_RINGBUF {
                return Err(invalid(format!(
                    "size of ringbuf chardev must be at most {} MiB in stord",
                    MAX_RINGBUF >> 20
                )));
            }
            Open::Ringbuf(RingBuf {
                cap: *size as usize,
                bytes: VecDeque::new(),
            })
        }
        Chardev::File { out, append } => {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .append(*append)
                .truncate(!*append)
                .open(out)
                .map_err(|e| {
                    invalid(format!(
                        "Could not open '{}': {}",
                        out.display(),
                        crate::sys::os_text(&e)
                    ))
                })?;
            Open::File(f)
        }
        Chardev::Listen(addr) => {
            let (fd, path): (OwnedFd, _) = match addr {
                SocketAddr::Unix(p) => {
                    let _ = std::fs::remove_file(p);
                    let l = std::os::unix::net::UnixListener::bind(p)
                        .map_err(|e| socket_error(addr, e))?;
                    (l.into(), Some(p.clone()))
                }
                SocketAddr::Inet { host, port } => {
                    let l = std::net::TcpListener::bind((host.as_str(), *port))
                        .map_err(|e| socket_error(addr, e))?;
                    (l.into(), None)
                }
            };
            Open::Socket { _fd: fd, path }
        }
        Chardev::Connect(addr) => {
            let fd: OwnedFd = match addr {
                SocketAddr::Unix(p) => std::os::unix::net::UnixStream::connect(p)
                    .map_err(|e| socket_error(addr, e))?
                    .into(),
                SocketAddr::Inet { host, port } => {
                    std::net::TcpStream::connect((host.as_str(), *port))
                        .map_err(|e| socket_error(addr, e))?
                        .into()
                }
            };
            Open::Socket {
                _fd: fd,
                path: None,
            }
        }
    })
}

fn socket_error(addr: &SocketAddr, e: std::io::Error) -> ChardevError {
    let to = match addr {
        SocketAddr::Unix(p) => p.display().to_string(),
        SocketAddr::Inet { host, port } => format!("{host}:{port}"),
    };
    invalid(format!(
        "Failed to connect to '{to}': {}",
        crate::sys::os_text(&e)
    ))
}

impl Table {
    /// A `--chardev`, opened later unless a monitor takes it.
    pub fn add(&mut self, id: &str, dev: Chardev) -> Result<(), ChardevError> {
        if self.entries.contains_key(id) {
            return Err(invalid(format!("Chardev with id '{id}' already exists")));
        }
        self.check_stdio(&dev)?;
        self.entries.insert(
            id.to_string(),
            Entry {
                dev,
                used: false,
                open: Open::Pending,
                log: None,
            },
        );
        Ok(())
    }

    /// QEMU lets one chardev have standard input and output.
    fn check_stdio(&self, dev: &Chardev) -> Result<(), ChardevError> {
        if *dev == Chardev::Stdio && self.entries.values().any(|e| e.dev == Chardev::Stdio) {
            return Err(invalid("cannot use stdio by multiple character devices"));
        }
        Ok(())
    }

    /// `--monitor chardev=ID`: the device, now used by a monitor (None: no such, or taken).
    pub fn take_for_monitor(&mut self, id: &str) -> Option<Chardev> {
        let e = self.entries.get_mut(id).filter(|e| !e.used)?;
        e.used = true;
        Some(e.dev.clone())
    }

    /// A monitor made at run time (`object-add monitor-qmp`) takes device `id`: the
    /// device, and for a socket already opened a duplicate of its descriptor (the table
    /// keeps the socket, so the device outlives the monitor, as QEMU's chardev does).
    pub fn attach_monitor(&mut self, id: &str) -> Result<(Chardev, Option<OwnedFd>), ChardevError> {
        let Some(e) = self.entries.get_mut(id) else {
            return Err(invalid(format!("chardev \"{id}\" not found")));
        };
        if e.used {
            return Err(invalid(format!("Device '{id}' is in use")));
        }
        let fd = match &e.open {
            Open::Socket { _fd, .. } => Some(_fd.try_clone().map_err(|err| {
                invalid(format!("chardev '{id}': {}", crate::sys::os_text(&err)))
            })?),
            _ => None,
        };
        e.used = true;
        Ok((e.dev.clone(), fd))
    }

    /// The monitor on device `id` went: the device is free again (opened, if the
    /// monitor was the one that opened it).
    pub fn detach_monitor(&mut self, id: &str) {
        if let Some(e) = self.entries.get_mut(id) {
            e.used = false;
            if matches!(e.open, Open::Pending) {
                e.open = open(&e.dev).unwrap_or(Open::Nothing);
            }
        }
    }

    /// Opens every `--chardev` no monitor took.
    pub fn open_unused(&mut self) -> Result<(), ChardevError> {
        for (id, e) in self.entries.iter_mut() {
            if !e.used && matches!(e.open, Open::Pending) {
                e.open = open(&e.dev).map_err(|err| invalid(format!("chardev '{id}': {err}")))?;
            }
        }
        Ok(())
    }

    /// `chardev-add`.
    pub fn add_open(&mut self, id: &str, dev: Chardev) -> Result<(), ChardevError> {
        if self.entries.contains_key(id) {
            return Err(invalid(format!("Chardev with id '{id}' already exists")));
        }
        if self.entries.len() >= MAX_CHARDEVS {
            return Err(invalid(format!(
                "Failed to add chardev '{id}': too many chardevs (at most {MAX_CHARDEVS})"
            )));
        }
        let failed = |e: ChardevError| invalid(format!("Failed to add chardev '{id}': {e}"));
        self.check_stdio(&dev).map_err(failed)?;
        let open = open(&dev).map_err(failed)?;
        self.entries.insert(
            id.to_string(),
            Entry {
                dev,
                used: false,
                open,
                log: None,
            },
        );
        Ok(())
    }

    /// `chardev-change`: the device gets a new backend (opened before the old one goes).
    pub fn change(&mut self, id: &str, dev: Chardev) -> Result<(), ChardevError> {
        let Some(e) = self.entries.get(id) else {
            return Err(invalid(format!("Chardev '{id}' does not exist")));
        };
        if e.used {
            return Err(invalid("Chardev user does not support chardev hotswap"));
        }
        if e.dev != Chardev::Stdio {
            self.check_stdio(&dev)?;
        }
        let new = open(&dev)?;
        let e = self.entries.get_mut(id).expect("present");
        e.open = new;
        e.dev = dev;
        Ok(())
    }

    /// `chardev-remove`.
    pub fn remove(&mut self, id: &str) -> Result<(), ChardevError> {
        match self.entries.get(id) {
            None => Err(invalid(format!("Chardev '{id}' not found"))),
            Some(e) if e.used => Err(invalid(format!("Chardev '{id}' is busy"))),
            Some(_) => {
                self.entries.remove(id);
                Ok(())
            }
        }
    }

    /// Device `id` logs what it sends to `log` (its `logfile`, opened when it was made).
    pub fn set_log(&mut self, id: &str, log: Option<SharedLog>) {
        if let Some(e) = self.entries.get_mut(id) {
            e.log = log;
        }
    }

    /// Device `id`'s log, if it has one (the monitor on it writes there too).
    pub fn log_of(&self, id: &str) -> Option<SharedLog> {
        self.entries.get(id)?.log.clone()
    }

    /// Whether `id` exists (`chardev-send-break` has nobody to tell on a device without
    /// a user, and a monitor ignores a break).
    pub fn contains(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// The ringbuf `id` (QEMU's texts when it is not one).
    pub fn ringbuf(&mut self, id: &str) -> Result<&mut RingBuf, ChardevError> {
        match self.entries.get_mut(id) {
            None => Err(invalid(format!("Device '{id}' not found"))),
            Some(Entry {
                open: Open::Ringbuf(r),
                ..
            }) => Ok(r),
            Some(_) => Err(invalid(format!("{id} is not a ringbuf device"))),
        }
    }

    /// Every device: id, the device, and whether a monitor uses it.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Chardev, bool)> {
        self.entries
            .iter()
            .map(|(id, e)| (id.as_str(), &e.dev, e.used))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ringbuf_keeps_the_last_bytes_and_reads_the_oldest_first() {
        let mut t = Table::default();
        let ring = |size| Chardev::Ringbuf {
            size,
            memory: false,
        };
        assert!(t
            .add_open("bad", ring(15))
            .unwrap_err()
            .to_string()
            .contains("power of two"));
        t.add_open("r", ring(8)).unwrap();
        assert!(t
            .add_open("huge", ring(MAX_RINGBUF * 2))
            .unwrap_err()
            .to_string()
            .contains("at most"));
        assert!(t
            .add_open("r", Chardev::Null)
            .unwrap_err()
            .to_string()
            .contains("already exists"));
        t.ringbuf("r").unwrap().write(b"0123456789");
        assert_eq!(t.ringbuf("r").unwrap().read(3), b"234");
        assert_eq!(t.ringbuf("r").unwrap().read(100), b"56789");
        t.add_open("n", Chardev::Null).unwrap();
        assert_eq!(
            t.ringbuf("n").unwrap_err().to_string(),
            "n is not a ringbuf device"
        );
        assert_eq!(
            t.ringbuf("x").unwrap_err().to_string(),
            "Device 'x' not found"
        );
        t.change("n", ring(4)).unwrap();
        t.ringbuf("n").unwrap().write(b"ab");
        t.remove("n").unwrap();
        assert!(t.remove("n").is_err());
    }
}
