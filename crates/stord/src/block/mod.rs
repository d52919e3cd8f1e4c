//! The block layer: nodes and their drivers.
//!
//! - [`node`]: the node machinery. `BlockNode` (a named driver instance with its flags,
//!   users, bitmaps and hooks) and the `BlockDriver` trait every driver implements, with
//!   what hangs off a node: permissions, hooks, dirty bitmaps, statistics, blockers, links.
//! - [`open`] and [`create`]: a driver's contract with the graph builder and with
//!   `blockdev-create`.
//! - [`drivers`]: every driver, each in a room of its own, and `BLOCK_DRIVERS`, the one list.
//! - [`throttle_group`]: the `throttle-group` object the `throttle` filter admits requests by.
//! - [`helper_thread`]: block requests run to completion on a thread of their own.
//!
//! Layers, lowest first: `node` (knows no driver), then `open`/`create`, then the drivers,
//! then the table. Nothing below imports what is above it.

pub mod create;
pub mod driver_def;
pub mod drivers;
pub mod helper_thread;
pub mod node;
pub mod open;
pub mod throttle_group;
pub mod worker_pool;
