//! How the NBD server listens and treats new connections: the options of `--nbd-server`
//! and `nbd-server-start`, parsed by one parser.

use std::path::PathBuf;

use crate::cli::keyval::{KeyVal, OptionError};
use crate::nbd_wire::keepalive::KeepAlive;
use crate::nbd_wire::proto::MAX_PAYLOAD;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A unix socket path.
    Unix(PathBuf),
    /// host:port.
    Inet(String, u16),
}

impl ListenAddr {
    /// `addr.type=unix,addr.path=P` or `addr.type=inet,addr.host=H,addr.port=N`.
    pub fn from_options(kv: &mut KeyVal) -> Result<Self, OptionError> {
        Ok(
            match kv.take_choice("addr.type", &["unix", "inet"])?.as_deref() {
                Some("unix") => ListenAddr::Unix(PathBuf::from(kv.take_required("addr.path")?)),
                Some("inet") => {
                    let host = kv.take_required("addr.host")?;
                    let port = kv.take_required("addr.port")?;
                    let port = port
                        .parse()
                        .map_err(|_| kv.bad_value("addr.port", "a port number", &port))?;
                    ListenAddr::Inet(host, port)
                }
                _ => return Err(kv.missing("addr.type")),
            },
        )
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
            ListenAddr::Inet(h, p) => write!(f, "{h}:{p}"),
        }
    }
}

/// The keep-alive members of an inet address (QEMU's InetSocketAddress).
const KEEP_ALIVE_KEYS: &[&str] = &[
    "keep-alive",
    "keep-alive-count",
    "keep-alive-idle",
    "keep-alive-interval",
];

/// How the server listens and treats new connections (`--nbd-server`, `nbd-server-start`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdServerOpts {
    /// Where.
    pub addr: ListenAddr,
    /// An inet address's keep-alive (set on the listening socket; the connections it
    /// accepts inherit it, as QEMU 10.1 does).
    pub keep_alive: KeepAlive,
    /// Connections at once (0: no limit), as qsd's `max-connections`.
    pub max_connections: u32,
    /// Time a client has to finish the handshake (0: no limit), as qsd's
    /// `handshake-max-seconds` (default 10).
    pub handshake_max_secs: u32,
    /// The id of the `tls-creds-*` object clients must use, if any.
    pub tls_creds: Option<String>,
    /// The id of the `authz-simple` object that admits TLS clients, if any.
    pub tls_authz: Option<String>,
    /// Request data all connections together may hold (`x-buffer-limit`, stord's own).
    pub buffer_limit: usize,
}

/// Default `x-buffer-limit`: request data all of the server's connections may hold at
/// once (each connection also holds at most its own 64 MiB).
pub const DEFAULT_BUFFER_LIMIT: usize = 512 << 20;

/// qsd's default for `handshake-max-seconds`.
pub const DEFAULT_HANDSHAKE_MAX_SECS: u32 = 10;

impl NbdServerOpts {
    /// The options of `--nbd-server` (flat `addr.type`, `addr.path` | `addr.host`,
    /// `addr.port`) and of `nbd-server-start` (its legacy `addr.data.*` form, flattened):
    /// the one parser of both.
    pub fn from_options(mut kv: KeyVal) -> Result<Self, OptionError> {
        let inet = kv.get("addr.type") == Some("inet");
        let keep_alive_keys = KEEP_ALIVE_KEYS.iter().filter(|_| inet);
        for k in ["path", "host", "port"].iter().chain(keep_alive_keys) {
            if let Some(v) = kv.take(&format!("addr.data.{k}")) {
                kv.insert(&format!("addr.{k}"), v);
            }
        }
        let addr = ListenAddr::from_options(&mut kv)?;
        let keep_alive = match addr {
            ListenAddr::Inet(..) => KeepAlive::from_options(&mut kv, "addr")?,
            ListenAddr::Unix(_) => KeepAlive::default(),
        };
        // QEMU's types: uint32 both (a larger value is refused, not cut down).
        let u32_range = 0..=u64::from(u32::MAX);
        let max_connections = kv
            .take_u64_in("max-connections", false, u32_range.clone())?
            .map_or(0, |v| v as u32);
        let handshake_max_secs = kv
            .take_u64_in("handshake-max-seconds", false, u32_range)?
            .map_or(DEFAULT_HANDSHAKE_MAX_SECS, |s| s as u32);
        let tls_creds = kv.take("tls-creds");
        let tls_authz = kv.take("tls-authz");
        // At least the largest request, at most 64 GiB.
        let buffer_limit = kv
            .take_u64_in("x-buffer-limit", true, u64::from(MAX_PAYLOAD)..=64 << 30)?
            .map_or(DEFAULT_BUFFER_LIMIT, |v| v as usize);
        kv.finish()?;
        Ok(Self {
            addr,
            keep_alive,
            max_connections,
            handshake_max_secs,
            tls_creds,
            tls_authz,
            buffer_limit,
        })
    }
}
