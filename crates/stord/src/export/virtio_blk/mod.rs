//! The virtio-blk device, whatever transport drives it: what the guest sees of the disk
//! ([`device`]), a virtqueue served on an IoThread ([`vring`]) with its descriptor chains
//! ([`chain`]) and requests ([`request`]), the log of requests in flight that outlives the
//! daemon ([`inflight`]), guest memory that vanishes ([`guest_fault`]), and the [`Export`]
//! both transports share ([`export`]).
//!
//! The transports sit above it, as rust-vmm's vhost-user-backend keeps its device apart
//! from the protocol: [`vhost_user_blk`](super::vhost_user_blk) (a VMM's frontend over a
//! socket, guest memory from its memory table) and [`vduse_blk`](super::vduse_blk) (the
//! host kernel, memory from its IOVA space). Each sets up a queue and hands it over as a
//! [`VringStart`](vring::VringStart); from there the data path is the same code.
//!
//! [`Export`]: crate::export::Export

mod chain;
pub(crate) mod device;
pub(crate) mod export;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
pub(crate) mod guest_fault;
pub(crate) mod inflight;
mod request;
pub(crate) mod vring;
