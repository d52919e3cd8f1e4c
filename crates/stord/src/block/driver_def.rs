//! [`DriverDef`]: what each driver module exports for the table in [`super::drivers`]: its
//! names, its `open` ([`super::open`]), its help text and, if it creates or amends images,
//! its `blockdev-create` ([`super::create`]) and `x-blockdev-amend` parts.

use std::sync::Arc;

use super::create::{CreateDef, CreateEnv, Creation};
use super::node::block_node::BlockNode;
use super::open::Open;
use crate::cli::Help;

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
    pub create: Option<&'static CreateDef>,
    /// What `x-blockdev-amend` may change in its images, if anything.
    pub amend: Option<&'static AmendDef>,
}

/// What `x-blockdev-amend` changes in a driver's open image (QEMU's bdrv_co_amend).
pub struct AmendDef {
    /// The members of the driver's BlockdevAmendOptions variant.
    pub args: &'static [crate::schema::Arg],
    /// Prepares the amendment of the node's image from the options (checked against
    /// `args`) and the command's `force`, looking up what it needs in the daemon now (the
    /// secrets it names), as a creation is prepared: an error fails the command (QEMU's
    /// bdrv_amend_pre_run), the work's error fails the `amend` job.
    pub prepare: AmendPrepare,
}

/// See [`AmendDef::prepare`].
pub type AmendPrepare = fn(
    &Arc<BlockNode>,
    &serde_json::Map<String, serde_json::Value>,
    bool,
    &dyn CreateEnv,
) -> Result<Creation, String>;
