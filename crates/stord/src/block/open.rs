//! Opening a driver: what it sees of the graph while it opens ([`Graph`]), what it is told
//! ([`OpenFlags`]) and gives back ([`Opened`]), and the graph layer's error.
//!
//! A driver opens from its options and a [`Graph`]: the graph builder (the daemon's)
//! resolves children named by node-name, opens inline ones (`file.driver=...`) with the
//! options children inherit, opens the backing files an image names, and takes back
//! everything it opened if any later step fails. Drivers never see the daemon's tables.

use std::sync::Arc;

use super::node::block_node::{BlockDriver, BlockNode};
use super::node::dirty_bitmap::DirtyBitmap;
use super::node::perm::PermError;
use super::throttle_group::ThrottleGroup;
use crate::cli::keyval::{KeyVal, OptionError};

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

    /// The external data file an image names (qcow2's `data-file` from its header): a
    /// protocol node (`file`, `host_device` for a device) of that name as it stands (QEMU
    /// resolves a relative one against the working directory), with what children inherit
    /// from the image being opened (read-only among it).
    fn data_file(&mut self, name: &str) -> Result<Arc<BlockNode>, GraphError>;

    /// The throttle group `id`.
    fn throttle_group(&self, id: &str) -> Option<Arc<ThrottleGroup>>;

    /// The bytes of the `secret` object `id` (a cluster key).
    fn secret(&self, id: &str) -> Option<Vec<u8>>;

    /// The `endpoint=client` TLS credentials `id` (an NBD client's), or why not.
    fn client_tls_creds(&self, id: &str) -> Result<Arc<crate::tls::creds::TlsCreds>, String>;
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
    pub bitmaps: Vec<DirtyBitmap>,
}

/// Opens a driver from its options (`driver`, `node-name` and the common options taken).
pub type Open = fn(&mut dyn Graph, &mut KeyVal, OpenFlags<'_>) -> Result<Opened, GraphError>;
