//! The one table of export types: adding one is its folder plus an entry here, with its
//! help text (for `--help`, the man page and docs/usage.md).

use super::{fuse, nbd, vduse_blk, vhost_user_blk, ExportType};
use crate::cli::Help;

/// Every export type.
pub const EXPORT_TYPES: &[ExportType] = &[
    ExportType {
        name: "nbd",
        create: nbd::handle::create,
        supports_inactive: true,
        help: Help {
            synopsis: "\n\
                       [,name=<export name>][,description=<text>][,writable=on|off]\n\
                       [,multi-conn=on|off|auto][,allocation-depth=on|off]\n\
                       [,bitmaps.0=<bitmap>,bitmaps.1=<bitmap>...]\n\
                       [,iothread=<id> | ,iothread.0=<id>,iothread.1=<id>...]\n\
                       [,allow-inactive=on|off][,x-buffer-limit=<size>]",
            about: "a node over NBD, on the --nbd-server's socket (each bitmap as\n\
                    qemu:dirty-bitmap:<name>)",
        },
    },
    ExportType {
        name: "fuse",
        create: fuse::export::create,
        supports_inactive: false,
        help: Help {
            synopsis: "mountpoint=<file>\n\
                       [,writable=on|off][,growable=on|off]\n\
                       [,allow-other=on|off|auto][,io-uring=on|off|auto]\n\
                       [,iothread=<id> | ,iothread.0=<id>...]",
            about: "a node as a regular file (FUSE, over /dev/fuse or\n\
                    FUSE-over-io_uring)",
        },
    },
    ExportType {
        name: "vhost-user-blk",
        create: vhost_user_blk::create,
        supports_inactive: false,
        help: Help {
            synopsis: "addr.type=unix,addr.path=<path>\n\
                       [,writable=on|off][,num-queues=<n>][,logical-block-size=<n>]\n\
                       [,iothread=<id> | ,iothread.0=<id>...]",
            about: "a node as a virtual machine's virtio disk (vhost-user-blk)",
        },
    },
    ExportType {
        name: "vduse-blk",
        create: vduse_blk::create,
        supports_inactive: false,
        help: Help {
            synopsis: "name=<vduse name>\n\
                       [,writable=on|off][,num-queues=<n>][,queue-size=<n>]\n\
                       [,logical-block-size=<n>][,serial=<str>]\n\
                       [,iothread=<id> | ,iothread.0=<id>...]",
            about: "a node as a virtio-blk device of the host kernel (VDUSE;\n\
                    attach it with `vdpa dev add name <name> mgmtdev vduse`)",
        },
    },
];
