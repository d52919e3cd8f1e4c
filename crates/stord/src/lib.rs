//! stord: block nodes exported over NBD, FUSE and vhost-user-blk, on `stord-aio` loops.
