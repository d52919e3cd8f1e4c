//! Copy-before-write: the mechanism under a backup and a fleecing export
//! ([`block_copy`], QEMU's block-copy with its copy-before-write), and the
//! `copy-before-write` filter node that puts it in a graph ([`filter`]).

pub mod block_copy;
pub mod filter;
