//! The NBD protocol as both sides speak it: wire constants ([`proto`]) and buffered socket
//! input with gathered output ([`io`]), shared by the NBD server (`export::nbd`) and the
//! NBD client node (`block::nbd`).

pub mod io;
pub mod proto;
