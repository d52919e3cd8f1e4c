//! Exports: how block nodes reach clients. One folder per protocol.

pub mod fuse;
pub mod nbd;
pub mod vhost_user_blk;
