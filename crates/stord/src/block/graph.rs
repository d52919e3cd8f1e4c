//! Opening nodes: the driver table and what a driver sees of the graph while it opens.
//!
//! Each driver module exports one [`DriverDef`] (its names, an `open` function, its help
//! text and, if it creates images, its `blockdev-create` part) and [`BLOCK_DRIVERS`] lists
//! them, so a new driver is one module plus a line: `--help`, the driver enum in
//! `query-qmp-schema` and `blockdev-create` come from the table. A driver opens
//! from its options and a [`Graph`]: the graph builder (the daemon's) resolves children
//! named by node-name, opens inline ones (`file.driver=...`) with the options children
//! inherit, opens the backing files an image names, and takes back everything it opened
//! if any later step fails. Drivers never see the daemon's tables.

use std::sync::Arc;

use super::perm::PermError;
use super::throttle::ThrottleGroup;
use super::{BlockDriver, BlockNode};
use crate::cli::keyval::{KeyVal, OptionError};
use crate::cli::Help;
use crate::schema::{EnumType, UnionType};

/// Why a node could not be opened: the graph layer's error. Texts are QEMU's where it has
/// one.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// A malformed or unknown option.
    #[error(transparent)]
    Option(#[from] OptionError),
    /// Options that parse but describe something the driver cannot open (its own checks,
    /// an image it refuses, an I/O error).
    #[error("{0}")]
    Invalid(String),
    #[error("Duplicate nodes with node-name='{0}'")]
    DuplicateNode(String),
    #[error("Cannot find device='{0}' nor node-name='{0}'")]
    ChildNotFound(String),
    /// A lock or permission conflict on a child.
    #[error(transparent)]
    Perm(#[from] PermError),
}

impl From<String> for GraphError {
    fn from(s: String) -> Self {
        GraphError::Invalid(s)
    }
}

/// What a driver may ask of the graph while it opens.
pub trait Graph {
    /// The child `role`: `role=NAME` names an existing node, `role.driver=...` opens one
    /// inline (with what children inherit from the node being opened).
    fn child(&mut self, kv: &mut KeyVal, role: &str) -> Result<Arc<BlockNode>, GraphError>;

    /// An optional child (`backing`): None when not given, Some(None) for `role=null`.
    fn optional_child(
        &mut self,
        kv: &mut KeyVal,
        role: &str,
    ) -> Result<Option<Option<Arc<BlockNode>>>, GraphError>;

    /// The backing file an image names: read-only, relative to the image's directory, its
    /// format from the image or probed, as QEMU opens it.
    fn backing_file(
        &mut self,
        image: &BlockNode,
        name: &str,
        format: Option<String>,
    ) -> Result<Arc<BlockNode>, GraphError>;

    /// The throttle group `id`.
    fn throttle_group(&self, id: &str) -> Option<Arc<ThrottleGroup>>;

    /// The bytes of the `secret` object `id` (a cluster key).
    fn secret(&self, id: &str) -> Option<Vec<u8>>;

    /// The `endpoint=client` TLS credentials `id` (an NBD client's), or why not.
    fn client_tls_creds(&self, id: &str) -> Result<Arc<crate::tls::TlsCreds>, String>;
}

/// What a driver's `open` is told besides its options.
#[derive(Debug, Clone, Copy)]
pub struct OpenFlags<'a> {
    /// `read-only=on` was asked for.
    pub read_only: bool,
    /// The new node's name (for the permissions it takes while it opens).
    pub node_name: &'a str,
    /// `active=off`: it opens inactive (it writes nothing, not even its metadata, until
    /// `blockdev-set-active`).
    pub inactive: bool,
}

/// An opened driver and what the node over it is.
pub struct Opened {
    pub driver: Box<dyn BlockDriver>,
    /// Read-only (asked for, or its child cannot write).
    pub read_only: bool,
    /// Bypasses the page cache (O_DIRECT), as its file does.
    pub direct: bool,
    /// Persistent dirty bitmaps the image holds (qcow2), for the node to carry.
    pub bitmaps: Vec<super::dirty_bitmap::DirtyBitmap>,
}

/// Opens a driver from its options (`driver`, `node-name` and the common options taken).
pub type Open = fn(&mut dyn Graph, &mut KeyVal, OpenFlags<'_>) -> Result<Opened, GraphError>;

/// One block driver.
pub struct DriverDef {
    /// `driver=` values that select it (QEMU's name first).
    pub names: &'static [&'static str],
    pub open: Open,
    /// Reads `discard` itself (else the common options take it).
    pub takes_discard: bool,
    /// Reads `cache.direct` and `cache.no-flush` itself (else they are passed on to its
    /// inline children).
    pub takes_cache: bool,
    /// Its options beside `driver` and `node-name`, for `--help` and docs/usage.md.
    pub help: Help,
    /// How it creates images (`blockdev-create`), if it does.
    pub create: Option<&'static super::create::CreateDef>,
    /// What `x-blockdev-amend` may change in its images, if anything.
    pub amend: Option<&'static AmendDef>,
}

/// What `x-blockdev-amend` changes in a driver's open image (QEMU's bdrv_co_amend).
pub struct AmendDef {
    /// The members of the driver's BlockdevAmendOptions variant.
    pub args: &'static [crate::schema::Arg],
    /// The amendment, checked against `args`: an error fails the `amend` job.
    pub run: fn(&BlockNode, &serde_json::Map<String, serde_json::Value>) -> Result<(), String>,
}

/// Every block driver.
pub const BLOCK_DRIVERS: &[&DriverDef] = &[
    &super::null::DRIVER,
    &super::file::DRIVER,
    &super::raw::DRIVER,
    &super::throttle::DRIVER,
    &super::qcow2::DRIVER,
    &super::nbd::DRIVER,
    &super::rbd::DRIVER,
    &super::cbw_driver::DRIVER,
    &super::snapshot_access::DRIVER,
];

/// The driver `name` selects.
pub fn driver(name: &str) -> Option<&'static DriverDef> {
    BLOCK_DRIVERS
        .iter()
        .copied()
        .find(|d| d.names.contains(&name))
}

/// Every `driver=` value.
pub fn all_driver_names() -> Vec<&'static str> {
    BLOCK_DRIVERS
        .iter()
        .flat_map(|d| d.names.iter().copied())
        .collect()
}

/// The names, for "expects ..." errors.
pub fn driver_names() -> String {
    all_driver_names().join(", ")
}

/// QAPI's `BlockdevDriver`: the `driver` of `blockdev-add` and of `blockdev-create`.
pub static BLOCKDEV_DRIVER: EnumType = EnumType {
    name: "BlockdevDriver",
    values: all_driver_names,
};

/// QAPI's `BlockdevAmendOptions`: `driver`, then the members of its [`AmendDef`].
pub static BLOCKDEV_AMEND_OPTIONS: UnionType = UnionType {
    name: "BlockdevAmendOptions",
    tag: "driver",
    tag_type: &BLOCKDEV_DRIVER,
    variants: || {
        BLOCK_DRIVERS
            .iter()
            .filter_map(|d| Some((d.names[0], d.amend?.args)))
            .collect()
    },
};

/// QAPI's `BlockdevCreateOptions`: `driver`, then the members of that driver's
/// [`CreateDef`](super::create::CreateDef).
pub static BLOCKDEV_CREATE_OPTIONS: UnionType = UnionType {
    name: "BlockdevCreateOptions",
    tag: "driver",
    tag_type: &BLOCKDEV_DRIVER,
    variants: || {
        BLOCK_DRIVERS
            .iter()
            .filter_map(|d| Some((d.names[0], d.create?.args)))
            .collect()
    },
};
