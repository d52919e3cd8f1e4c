//! The vhost-user-blk clients the benchmarks drive an export with, picked by name: `own`,
//! a frontend of our own with one queue ([`frontend`]), and `blkio` or `blkio-poll`,
//! libblkio with blocking or poll queues, which can also use several ([`libblkio`], which
//! also drives many devices at once for the density benchmark). What they drive is a
//! [`DriveSpec`].

mod frontend;
pub(crate) mod libblkio;
pub(crate) mod spec;

use std::path::Path;

use libblkio::QueueKind;
pub(crate) use spec::DriveSpec;

use crate::peers::FioResult;

/// Runs one measurement with `client` (`own`, `blkio`, `blkio-poll`).
pub(crate) fn drive_with(client: &str, sock: &Path, spec: &DriveSpec, queues: usize) -> FioResult {
    match client {
        "own" => {
            assert_eq!(queues, 1, "our own frontend drives one queue");
            frontend::drive(sock, spec)
        }
        "blkio" => libblkio::drive(sock, spec, QueueKind::Blocking, queues),
        "blkio-poll" => libblkio::drive(sock, spec, QueueKind::Poll, queues),
        other => panic!("unknown vhost-user-blk client {other} (own, blkio, blkio-poll)"),
    }
}
