//! The `qcow2` format driver: QEMU's copy-on-write image format (versions 2 and 3) over a
//! child node (its `file`), with an optional `backing` node read through where a cluster
//! is not allocated.
//!
//! A request maps its guest range cluster by cluster through the L1 and L2 tables
//! ([`metadata`]). In steady state (tables cached, clusters allocated) a read or write is
//! one lookup under the metadata lock and one request to the child, with the caller's
//! buffer passed straight through when the range is contiguous on the host. A write into
//! a cluster that is unallocated, zero, compressed or shared allocates a new cluster under
//! a lock on that guest cluster (concurrent writers of one cluster allocate it once),
//! copies what it does not overwrite from the old content (backing file, compressed
//! data) and then points the L2 entry at it; metadata changes reach the disk in the
//! crash-safe order [`writeback`] describes, at the next flush.
//!
//! Images with internal snapshots are written as QEMU writes them: tables and clusters
//! the active image shares with a snapshot are copied before they change ([`snapshot`]).
//!
//! Images with extended L2 entries (subclusters, as Proxmox makes its snapshot overlays)
//! are read, written, zeroed and reported per subcluster ([`subcluster`]).
//!
//! Compressed clusters are read (zlib or zstd, as the header says), and written where a
//! request asks for it (backup's `compress`: [`compress`]), packed into shared host
//! clusters as QEMU packs them.
//!
//! Images whose guest data lives in an external data file (`data-file`, with or without
//! `data-file-raw`) keep their metadata here and their data there, cluster for cluster at
//! the guest's offsets ([`data_file`]).
//!
//! Encrypted images (`encrypt.format=luks`) decrypt what they read and encrypt what they
//! write, by sector of the host file ([`crypt`]).
//!
//! Not supported, and refused at open with a clear error rather than served wrongly:
//! legacy AES encryption; writing to images marked corrupt.
//!
//! The files, from the bottom up: the on-disk formats, parsed with no I/O ([`bytes`],
//! [`header`], [`table`], [`subcluster`], [`snapshot`], [`bitmap_dir`]); the driver's state
//! ([`driver`]); its methods by concern ([`metadata`], [`refcount`], [`writeback`],
//! [`read`], [`write`], [`compress`], [`crypt`], [`discard`], [`block_status`],
//! [`header_update`], [`bitmaps`], [`internal`], [`data_file`]); an image read at open
//! ([`image`], with [`repair`]); and the faces:
//! [`open`] (the driver table's entry, with [`options`]) and [`block_driver`].

mod amend;
mod bitmap_dir;
mod bitmaps;
mod block_driver;
mod block_status;
mod bytes;
mod compress;
pub mod create;
mod create_crypt;
mod crypt;
mod data_file;
mod discard;
mod driver;
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod fuzz;
mod header;
mod header_update;
mod image;
mod internal;
mod metadata;
mod open;
mod options;
mod read;
mod refcount;
mod repair;
mod snapshot;
mod subcluster;
mod table;
mod write;
mod writeback;

pub use driver::Qcow2Driver;
/// Fuzz entry (`fuzz/fuzz_targets/qcow2_header.rs`): see [`fuzz::fuzz_header`].
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub use fuzz::fuzz_header as fuzz;
pub use header::{has_magic, Compression, Header, HeaderError};
pub use image::{Image, Qcow2Error};
pub use open::DRIVER;
pub use options::Qcow2Options;
