//! The NBD export: a server socket (unix or TCP) and the exports it offers.
//!
//! New connections are accepted and negotiated on the main loop ([`handshake`]); once the
//! client has chosen an export, the connection moves to one of that export's IoThreads (the
//! one with the fewest of its connections), where its requests run as tasks
//! ([`transmission`]). Several IoThreads let a multi-connection client (nbdcopy, fio with
//! several jobs, the kernel client) use several cores; qsd 10 serves all of an export's
//! connections on one thread.
//!
//! With `tls-creds`, every client must start TLS (STARTTLS) before anything else; the
//! session moves with the connection to its IoThread.
//!
//! Lowest first: [`export`] (an export and the table of them the handshake looks names up
//! in), `handshake`, `transmission`, `connection` (one connection from accept to close),
//! [`options`] and [`server`] (the listening socket), [`handle`] (an export as the daemon
//! holds it, and `block-export-add`'s constructor).

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;

mod connection;
pub mod export;
pub mod handle;
mod handshake;
pub mod options;
pub mod server;
mod transmission;
