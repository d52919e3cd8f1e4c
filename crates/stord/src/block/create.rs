//! `blockdev-create`'s contract with the drivers (QEMU's `bdrv_co_create`).
//!
//! A driver that creates images gives its [`DriverDef`](super::driver_def::DriverDef) a
//! [`CreateDef`]: the members `options` takes beside `driver` (QEMU's
//! `BlockdevCreateOptions` branch, which the monitor checks and `query-qmp-schema` lists)
//! and a `prepare` that turns the checked options into the work a `create` job runs. So
//! the monitor and the daemon know no driver by name: a new one is its module and its
//! table line.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;

use crate::block::node::block_node::BlockNode;
use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;
use crate::schema::{Arg, EnumType};

/// What `prepare` may look up in the daemon.
pub trait CreateEnv {
    /// The node `name` (the file a format image is written on).
    fn node(&self, name: &str) -> Option<Arc<BlockNode>>;
    /// The bytes of the `secret` object `id` (a cluster key).
    fn secret(&self, id: &str) -> Option<Vec<u8>>;
}

/// The job's work, run on the main loop; its error (QEMU's words) fails the job.
pub type Creation = Pin<Box<dyn Future<Output = Result<(), String>>>>;

/// Checks the options (already checked against `args`, flattened as `--blockdev` options
/// are) and prepares the creation. An error here fails the command and starts no job
/// (what stord does not create); what QEMU finds wrong only once the job runs (a node not
/// found, its own checks of the values) fails the job instead, as in QEMU.
pub type Prepare = fn(KeyVal, &dyn CreateEnv) -> Result<Creation, GraphError>;

/// How a driver creates images.
pub struct CreateDef {
    /// `options`' members beside `driver`, as QEMU's schema has them.
    pub args: &'static [Arg],
    pub prepare: Prepare,
}

/// A creation that fails when the job runs, with `why`.
pub fn failing(why: String) -> Creation {
    Box::pin(async move { Err(why) })
}

/// The command's error for an option stord does not create images with yet.
pub fn unsupported(what: &str) -> GraphError {
    GraphError::Invalid(format!(
        "blockdev-create: {what} is not supported by stord yet"
    ))
}

/// QAPI's `PreallocMode`, which file, luks and qcow2 creation take.
pub static PREALLOC_MODE: EnumType = EnumType {
    name: "PreallocMode",
    values: || vec!["off", "metadata", "falloc", "full"],
};

/// A `PreallocMode`: how much of a new image's storage is allocated up front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prealloc {
    #[default]
    Off,
    /// A format's metadata for every cluster (a file by itself cannot).
    Metadata,
    /// The storage allocated (fallocate).
    Falloc,
    /// The storage written with zeroes.
    Full,
}

impl Prealloc {
    /// `preallocation`, taken from `kv` (its value was checked against the schema).
    pub fn take(kv: &mut KeyVal) -> Result<Prealloc, GraphError> {
        Ok(match kv.take("preallocation").as_deref() {
            None | Some("off") => Prealloc::Off,
            Some("metadata") => Prealloc::Metadata,
            Some("falloc") => Prealloc::Falloc,
            Some("full") => Prealloc::Full,
            Some(p) => {
                return Err(GraphError::Invalid(format!(
                    "Parameter 'preallocation' does not accept value '{p}'"
                )))
            }
        })
    }

    /// QAPI's name.
    pub fn name(self) -> &'static str {
        match self {
            Prealloc::Off => "off",
            Prealloc::Metadata => "metadata",
            Prealloc::Falloc => "falloc",
            Prealloc::Full => "full",
        }
    }
}

/// Sets `node`'s size to `size`, a grown area allocated as `mode` asks (QEMU's truncate
/// with a PreallocMode, where `metadata` leaves the storage sparse): `falloc` allocates
/// it, `full` writes zeroes over it.
pub async fn resize_allocated(node: &Arc<BlockNode>, size: u64, mode: Prealloc) -> io::Result<()> {
    let from = node.size();
    match mode {
        Prealloc::Falloc => node.resize_preallocated(size).await,
        Prealloc::Full => {
            node.resize(size).await?;
            write_zeroes_over(node, from, size).await
        }
        Prealloc::Off | Prealloc::Metadata => node.resize(size).await,
    }
}

/// Zeroes written (not a write-zeroes request, which may leave the storage unallocated)
/// over `from..to`, a MiB at a time.
async fn write_zeroes_over(node: &Arc<BlockNode>, from: u64, to: u64) -> io::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut at = from;
    while at < to {
        let n = CHUNK.min(to - at);
        node.write(at, crate::buf::new_buf(n as usize), false)
            .await
            .0?;
        at += n;
    }
    Ok(())
}
