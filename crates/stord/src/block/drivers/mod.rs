//! The block drivers, each in a room of its own, and [`BLOCK_DRIVERS`], the one list of
//! them: a new driver is its module plus a line here. `--help`, the driver enum in
//! `query-qmp-schema`, `blockdev-create` and `x-blockdev-amend` come from the table.
//! What each driver exports, and what it sees while it opens, is [`super::open`].

pub mod blkdebug;
pub mod blklogwrites;
pub mod compress;
pub mod copy_before_write;
pub mod copy_on_read;
pub mod file;
mod filter;
pub mod luks;
pub mod nbd_client;
pub mod null;
pub mod preallocate;
pub mod qcow2;
pub mod raw;
pub mod rbd;
pub mod snapshot_access;
pub mod throttle;

use super::driver_def::DriverDef;
use crate::schema::{EnumType, UnionType};

/// Every block driver.
pub const BLOCK_DRIVERS: &[&DriverDef] = &[
    &null::DRIVER,
    &null::DRIVER_AIO,
    &file::DRIVER,
    &raw::DRIVER,
    &throttle::DRIVER,
    &qcow2::DRIVER,
    &luks::DRIVER,
    &nbd_client::DRIVER,
    &rbd::DRIVER,
    &copy_before_write::filter::DRIVER,
    &snapshot_access::DRIVER,
    &blkdebug::DRIVER,
    &blklogwrites::DRIVER,
    &compress::DRIVER,
    &copy_on_read::DRIVER,
    &preallocate::DRIVER,
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
