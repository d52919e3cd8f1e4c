//! The daemon layer: what the command line and QMP create (IoThreads, objects, block
//! nodes, exports, the NBD server) and the operations on them, as one API over [`State`].
//! The QMP handlers and the command line call it; it knows neither (events leave through
//! [`crate::events`]).
//!
//! [`state`] is what the daemon holds, with [`error`] its error; the operations are a
//! file per concern over it: [`graph`] opens nodes (the driver table, inline children,
//! rollback), [`nodes`] deletes, resizes and reopens them, [`exports`] and
//! [`nbd_server`] serve them, [`objects`] holds the `--object` types (and [`monitors`],
//! QMP monitors made at run time), [`jobs`] is the
//! graph side of each job (a file per job), [`chain`] and [`snapshot`] edit images and
//! the graph, [`active`] turns nodes inactive and back. This file only hands on the
//! names the rest of the daemon's users take.

mod active;
mod chain;
mod close;
pub mod error;
pub mod exports;
mod graph;
pub mod jobs;
mod lookup;
pub mod monitor_object;
pub mod monitors;
pub mod nbd_server;
mod new_image;
pub mod nodes;
pub mod objects;
pub mod snapshot;
pub mod state;
pub mod user_object;

pub use error::DaemonError;
pub use objects::{ObjectType, OBJECT_TYPES};
pub use state::{SharedState, State};
pub use user_object::UserObject;
