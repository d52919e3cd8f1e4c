//! The node machinery: [`block_node::BlockNode`] and the [`block_node::BlockDriver`] trait,
//! and what hangs off a node whatever its driver.
//!
//! Lowest first: the pieces that know nothing of nodes ([`future`], [`options`], [`perm`]'s
//! model, [`hook`]'s trait, [`stats`], [`dirty_bitmap`], [`range_lock`], [`limits`],
//! [`debug_event`]); then
//! [`block_node`]; then what a node does or holds, each an `impl BlockNode` or a holder of
//! one ([`requests`], [`bitmaps`], [`claim`], [`hook_on`], [`blocker`], [`link`],
//! [`read_only_again`]).

pub mod bitmaps;
pub mod block_node;
pub mod blocker;
pub mod claim;
pub mod debug_event;
pub mod dirty_bitmap;
pub mod future;
pub mod hook;
pub mod hook_on;
pub mod limits;
pub mod link;
pub mod options;
pub mod perm;
pub mod range_lock;
pub mod read_only_again;
pub mod requests;
pub mod stats;
