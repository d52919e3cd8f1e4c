//! Exports: how block nodes reach clients. One folder per protocol.

pub mod nbd;
