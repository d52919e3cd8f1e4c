//! `rbd`: a node whose data is a Ceph RBD image, through librbd (QEMU's rbd driver).
//!
//! Opening connects to the cluster and opens the image, blocking as librados does (the
//! monitors answer or it times out). Requests go to librbd's asynchronous calls from the
//! issuing loop; librbd completes them on its own threads, and the completion wakes the
//! request's task, which hands it back to its loop through the loop's cross-thread
//! wake-up ([`ffi`] holds the C API and every `unsafe` of the driver). librbd has no FUA:
//! a FUA write is followed by a flush, as QEMU's block layer does for rbd.

mod ffi;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::block::create::{unsupported, CreateDef};
use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockStatus};
use crate::block::node::future::BoxFut;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use crate::schema::{opt, req, Ty};

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["rbd"],
    takes_discard: false,
    takes_cache: true,
    help: Help {
        synopsis: "pool=<pool>,image=<image>\n\
                   [,namespace=<name>][,snapshot=<name>][,conf=<file>][,user=<id>]\n\
                   [,server.0.host=<host>,server.0.port=<port>...][,key-secret=<secret id>]\n\
                   [,auth-client-required.0=cephx|none...][,cache.direct=on|off]\n\
                   [,cache.no-flush=on|off]",
        about: "an image in a Ceph cluster, through librbd (loaded when\n\
                the first rbd node opens: Debian's librbd1)",
    },
    create: Some(&CREATE),
    amend: None,
    open: |graph, kv, flags| {
        let opts = RbdOptions::from_kv(kv, &|id| graph.secret(id))?;
        let read_only = flags.read_only;
        let driver = RbdDriver::open(&opts, read_only).map_err(GraphError::Invalid)?;
        if opts.snapshot.is_some() && !read_only {
            // QEMU's auto-read-only check, after the open.
            return Err(GraphError::Invalid("rbd snapshots are read-only".into()));
        }
        Ok(Opened {
            driver: Box::new(driver),
            read_only,
            direct: opts.direct,
            bitmaps: Vec::new(),
        })
    },
};

/// `blockdev-create`'s part for `driver=rbd` (QEMU's BlockdevCreateOptionsRbd).
pub const CREATE: CreateDef = CreateDef {
    args: &[
        req("location", Ty::Object),
        req("size", Ty::Uint),
        opt("cluster-size", Ty::Uint),
        opt("encrypt", Ty::Any),
    ],
    prepare: |mut kv, env| {
        if kv.take("encrypt").is_some() || kv.take_prefixed("encrypt").is_some() {
            return Err(unsupported("'encrypt'"));
        }
        let mut loc = kv
            .take_object("location")
            .unwrap_or_else(|| KeyVal::from_pairs("options.location", []));
        let location = RbdOptions::from_kv(&mut loc, &|id| env.secret(id))?;
        loc.finish()?;
        let size = kv.take_u64("size", false)?.unwrap_or(0);
        let cluster_size = kv.take_u64("cluster-size", false)?;
        kv.finish()?;
        // librados blocks while it connects: on a worker.
        Ok(Box::pin(async move {
            crate::block::worker_pool::run(move || create(&location, size, cluster_size)).await
        }))
    },
};

/// Where the image is and how to reach its cluster (QEMU's BlockdevOptionsRbd).
#[derive(Debug, Clone, Default)]
pub struct RbdOptions {
    pub pool: String,
    pub namespace: Option<String>,
    pub image: String,
    pub snapshot: Option<String>,
    pub conf: Option<String>,
    pub user: Option<String>,
    /// Monitor addresses (`server.N.host`, `server.N.port`), as librados' mon_host.
    pub mon_host: Option<String>,
    /// The cephx key, from the `secret` object `key-secret` names.
    pub key: Option<String>,
    /// `auth-client-required`: `cephx` and/or `none`.
    pub auth_client_required: Option<String>,
    /// `cache.direct=on`: librbd's cache off (QEMU: `rbd_cache=false`); by default it is on,
    /// as QEMU sets it, and writes through until the first flush.
    pub direct: bool,
    /// `cache.no-flush=on`: flushes (and the flush after a FUA write) succeed at once.
    pub no_flush: bool,
}

impl RbdOptions {
    /// From the node's options; `secret` looks up a secret object's bytes.
    pub fn from_kv(
        kv: &mut KeyVal,
        secret: &dyn Fn(&str) -> Option<Vec<u8>>,
    ) -> Result<Self, GraphError> {
        if kv.take_prefixed("encrypt").is_some() || kv.take("encrypt.format").is_some() {
            return Err(GraphError::Invalid(
                "encrypt: stord's rbd driver does not do RBD encryption".into(),
            ));
        }
        let mut servers = Vec::new();
        for i in 0.. {
            let Some(host) = kv.take(&format!("server.{i}.host")) else {
                break;
            };
            let port = kv.take_required(&format!("server.{i}.port"))?;
            servers.push(if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            });
        }
        let key = match kv.take("key-secret") {
            None => None,
            Some(id) => {
                let bytes = secret(&id)
                    .ok_or_else(|| GraphError::Invalid(format!("No secret with id '{id}'")))?;
                Some(String::from_utf8(bytes).map_err(|_| {
                    GraphError::Invalid(format!("Data from secret {id} is not valid UTF-8"))
                })?)
            }
        };
        let auth = kv.take_list("auth-client-required");
        for a in &auth {
            if a != "cephx" && a != "none" {
                return Err(kv
                    .bad_value("auth-client-required", "cephx or none", a)
                    .into());
            }
        }
        Ok(RbdOptions {
            pool: kv.take_required("pool")?,
            namespace: kv.take("namespace"),
            image: kv.take_required("image")?,
            snapshot: kv.take("snapshot"),
            conf: kv.take("conf"),
            user: kv.take("user"),
            mon_host: (!servers.is_empty()).then(|| servers.join(";")),
            key,
            auth_client_required: (!auth.is_empty()).then(|| auth.join(";")),
            direct: kv.take_bool("cache.direct", false)?,
            no_flush: kv.take_bool("cache.no-flush", false)?,
        })
    }

    /// Connects to the cluster and opens the pool (blocking).
    fn connect(&self) -> Result<Arc<ffi::Cluster>, String> {
        let mut settings = Vec::new();
        if let Some(m) = &self.mon_host {
            settings.push(("mon_host", m.clone()));
        }
        if let Some(k) = &self.key {
            settings.push(("key", k.clone()));
        }
        if let Some(a) = &self.auth_client_required {
            settings.push(("auth_client_required", a.clone()));
        }
        // librbd's cache as QEMU sets it: off for cache.direct=on, else on (librbd keeps it
        // writethrough until the first flush, so a client that never flushes loses
        // nothing acknowledged).
        settings.push(("rbd_cache", (!self.direct).to_string()));
        let api = ffi::load().map_err(|e| e.to_string())?;
        ffi::Cluster::connect(
            api,
            &ffi::ConnectOptions {
                user: self.user.as_deref(),
                conf: self.conf.as_deref(),
                settings,
                pool: &self.pool,
                namespace: self.namespace.as_deref(),
            },
        )
        .map(Arc::new)
        .map_err(|e| format!("{}: {}", e.step, crate::sys::os_text(&e.err)))
    }

    /// QEMU's file name of the node: `json:{...}` with the location, spaced as QEMU
    /// writes JSON.
    fn filename(&self) -> String {
        let mut m: Vec<(&str, &str)> = vec![("pool", &self.pool)];
        if let Some(n) = &self.namespace {
            m.push(("namespace", n));
        }
        m.push(("image", &self.image));
        if let Some(s) = &self.snapshot {
            m.push(("snapshot", s));
        }
        if let Some(c) = &self.conf {
            m.push(("conf", c));
        }
        m.push(("driver", "rbd"));
        let members: Vec<String> = m
            .iter()
            .map(|(k, v)| format!("\"{k}\": {}", serde_json::Value::from(*v)))
            .collect();
        format!("json:{{{}}}", members.join(", "))
    }
}

/// `blockdev-create` of an rbd image: connects as a node would and creates it, with
/// objects of `cluster_size` bytes if given (QEMU's checks and words).
pub fn create(opts: &RbdOptions, size: u64, cluster_size: Option<u64>) -> Result<(), String> {
    if opts.snapshot.is_some() {
        return Err("Can't use snapshot name for image creation".into());
    }
    let order = match cluster_size {
        None => 0,
        Some(c) if !c.is_power_of_two() => return Err("obj size needs to be power of 2".into()),
        Some(c) if c < 4096 => return Err("obj size too small".into()),
        Some(c) => c.trailing_zeros(),
    };
    let cluster = opts.connect()?;
    cluster
        .create(&opts.image, size, order)
        .map_err(|e| format!("error rbd create: {}", crate::sys::os_text(&e)))
}

/// The rbd driver.
pub struct RbdDriver {
    image: Arc<ffi::Image>,
    size: AtomicU64,
    /// Bytes per RADOS object (QEMU reports it as the cluster size).
    object_size: u64,
    opts: RbdOptions,
}

impl RbdDriver {
    /// Connects and opens the image (blocking).
    pub fn open(opts: &RbdOptions, read_only: bool) -> Result<Self, String> {
        let cluster = opts.connect()?;
        let image = cluster
            .open(&opts.image, opts.snapshot.as_deref(), read_only)
            .map_err(|e| {
                format!(
                    "error reading header from {}: {}",
                    opts.image,
                    crate::sys::os_text(&e)
                )
            })?;
        let (size, object_size) = image.stat().map_err(|e| {
            format!(
                "error getting image info from {}: {}",
                opts.image,
                crate::sys::os_text(&e)
            )
        })?;
        Ok(RbdDriver {
            image: Arc::new(image),
            size: AtomicU64::new(size),
            object_size,
            opts: opts.clone(),
        })
    }
}

/// librbd takes lengths as size_t and answers whole requests; pieces of at most this keep
/// a write-zeroes or discard of a huge range in one call each.
const MAX_RANGE: u64 = 1 << 30;

impl BlockDriver for RbdDriver {
    fn driver_name(&self) -> &'static str {
        "rbd"
    }
    fn size(&self) -> u64 {
        self.size.load(Relaxed)
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            let (r, mut buf) = self.image.read(offset, buf).await;
            match r {
                // librbd reads holes as zeroes; a short count (past its end) reads so too.
                Ok(n) => {
                    let n = (n.max(0) as usize).min(buf.len());
                    buf[n..].fill(0);
                    (Ok(()), buf)
                }
                Err(e) => (Err(e), buf),
            }
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            let (r, buf) = self.image.write(offset, buf).await;
            if let Err(e) = r {
                return (Err(e), buf);
            }
            if fua {
                return (self.flush().await, buf);
            }
            (Ok(()), buf)
        })
    }
    fn no_flush(&self) -> bool {
        self.opts.no_flush
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if self.opts.no_flush {
                return Ok(());
            }
            self.image.flush().await
        })
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            let (mut at, end) = (offset, offset + len);
            while at < end {
                let n = (end - at).min(MAX_RANGE);
                self.image.discard(at, n).await?;
                at += n;
            }
            Ok(())
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            let (mut at, end) = (offset, offset + len);
            while at < end {
                let n = (end - at).min(MAX_RANGE);
                self.image.write_zeroes(at, n, !may_unmap).await?;
                at += n;
            }
            Ok(())
        })
    }
    /// From the object map (fast-diff), on a worker since librbd may read it from the
    /// cluster: unallocated objects read as zeroes. An image without a usable map, or an
    /// error, reports data, as QEMU's driver does.
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(async move {
            let image = self.image.clone();
            let object_size = self.object_size;
            let data = BlockStatus {
                len,
                allocated: true,
                zero: false,
            };
            match crate::block::worker_pool::run(move || {
                image.first_extent(offset, len, object_size)
            })
            .await
            {
                Ok(Some((allocated, n))) => Ok(BlockStatus {
                    len: n.clamp(1, len),
                    allocated,
                    zero: !allocated,
                }),
                Ok(None) => Ok(data),
                Err(e) => {
                    tracing::debug!(target: "stord::rbd", "block status: {e}");
                    Ok(data)
                }
            }
        })
    }
    fn block_status_costly(&self) -> bool {
        true
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            // rbd_resize blocks (it updates the image header): on a worker, which holds
            // the image until it is done even if this request is dropped.
            let image = self.image.clone();
            let r = crate::block::worker_pool::run(move || image.resize(size)).await;
            r?;
            self.size.store(size, Relaxed);
            Ok(())
        })
    }
    fn filename(&self) -> Option<String> {
        Some(self.opts.filename())
    }
    fn reports_host_size(&self) -> bool {
        false
    }
    fn cluster_size(&self) -> Option<u64> {
        Some(self.object_size)
    }
}
