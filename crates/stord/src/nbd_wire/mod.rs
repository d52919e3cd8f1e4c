//! The NBD protocol as both sides speak it: wire constants ([`proto`]), buffered socket
//! input with gathered output ([`io`]) and TCP keep-alive ([`keepalive`]), shared by the
//! NBD server (`export::nbd`) and the NBD client node (`block::nbd`).

pub mod io;
pub mod keepalive;
pub mod proto;
