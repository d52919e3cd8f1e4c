//! The log child's side of blklogwrites: where the next entry goes, how many there are,
//! and the superblock that records them. An entry's place is taken before its I/O (two
//! requests in flight write their entries side by side); the superblock is rewritten,
//! then the log flushed, after a flush entry and after every `update_interval`-th entry,
//! one rewrite at a time, skipped when a later one has already counted this entry.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use super::format::{self, Entry, Superblock};
use crate::block::node::block_node::BlockNode;
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::GraphError;
use crate::buf::{new_buf, Buf};

/// Where the log stands.
#[derive(Clone, Copy)]
struct Position {
    /// The sector the next entry goes to.
    next_sector: u64,
    entries: u64,
}

/// The log child and what the driver knows of it.
pub(super) struct Log {
    pub(super) node: Arc<BlockNode>,
    sector_size: u64,
    update_interval: u64,
    at: Mutex<Position>,
    /// How many entries the superblock on the log counts.
    counted: AtomicU64,
    /// One superblock rewrite at a time.
    rewriting: RangeLocks,
}

/// What an entry carries after its header sector.
pub(super) enum Payload<'a> {
    None,
    Data(&'a [u8]),
    /// A write-zeroes of this many bytes: zeroes written on the log as well.
    Zeroes(u64),
}

impl Log {
    /// A new log (its first entry at sector 1) or, with `append`, the log `node` holds.
    pub(super) fn open(
        node: Arc<BlockNode>,
        append: bool,
        sector_size: Option<u64>,
        update_interval: u64,
    ) -> Result<Log, GraphError> {
        let bad = |m: String| Err(GraphError::Invalid(m));
        let (sector_size, at) = if append {
            if sector_size.is_some() {
                return bad("log-append and log-sector-size are mutually exclusive".into());
            }
            Self::find_end(&node)?
        } else {
            let at = Position {
                next_sector: 1,
                entries: 0,
            };
            (sector_size.unwrap_or(512), at)
        };
        if !format::sector_size_valid(sector_size) {
            return bad(format!("Invalid log sector size {sector_size}"));
        }
        if update_interval == 0 {
            return bad("Invalid log superblock update interval 0".into());
        }
        Ok(Log {
            node,
            sector_size,
            update_interval,
            counted: AtomicU64::new(at.entries),
            at: Mutex::new(at),
            rewriting: RangeLocks::default(),
        })
    }

    /// The sector size of the log on `node` and where it ends, as QEMU finds them: the
    /// superblock (an empty log is one of 512-byte sectors), then each entry it counts.
    fn find_end(node: &Arc<BlockNode>) -> Result<(u64, Position), GraphError> {
        let bad = |m: String| GraphError::Invalid(m);
        let sb = if node.size() == 0 {
            Superblock::new(0, 512)
        } else {
            let b = read_at(node, 0, format::SUPER_LEN).map_err(|e| {
                bad(format!(
                    "Could not read log superblock: {}",
                    crate::sys::os_text(&e)
                ))
            })?;
            Superblock::parse(b[..].try_into().unwrap())
        };
        if sb.magic != format::MAGIC {
            return Err(bad("Invalid log superblock magic".into()));
        }
        if sb.version != format::VERSION {
            return Err(bad(format!("Unsupported log version {}", sb.version)));
        }
        let size = u64::from(sb.sector_size);
        let mut at = Position {
            next_sector: 1,
            entries: 0,
        };
        if !format::sector_size_valid(size) {
            return Ok((size, at));
        }
        while at.entries < sb.nr_entries {
            let b = read_at(node, at.next_sector * size, format::ENTRY_LEN).map_err(|e| {
                bad(format!(
                    "Failed to read log entry {}: {}",
                    at.entries,
                    crate::sys::os_text(&e)
                ))
            })?;
            let e = Entry::parse(b[..].try_into().unwrap());
            if e.flags & !format::FLAG_MASK != 0 {
                return Err(bad(format!(
                    "Invalid flags 0x{:x} in log entry {}",
                    e.flags, at.entries
                )));
            }
            at.next_sector += e.log_sectors();
            at.entries += 1;
        }
        Ok((size, at))
    }

    pub(super) fn sector_size(&self) -> u64 {
        self.sector_size
    }

    /// Appends `entry` with `payload` (whole sectors of it), then rewrites the superblock
    /// if this entry calls for it.
    pub(super) async fn append(&self, entry: Entry, payload: Payload<'_>) -> io::Result<()> {
        let data_len = match payload {
            Payload::Data(d) => d.len() as u64,
            _ => 0,
        };
        let zero_len = match payload {
            Payload::Zeroes(n) => n.next_multiple_of(self.sector_size),
            _ => 0,
        };
        let (offset, seq) = {
            let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
            let offset = at.next_sector * self.sector_size;
            at.next_sector +=
                1 + (data_len.next_multiple_of(self.sector_size) + zero_len) / self.sector_size;
            at.entries += 1;
            (offset, at.entries)
        };
        let mut sector: Buf =
            new_buf((self.sector_size + data_len.next_multiple_of(self.sector_size)) as usize);
        entry.write_to(&mut sector);
        if let Payload::Data(d) = payload {
            let from = self.sector_size as usize;
            sector[from..from + d.len()].copy_from_slice(d);
        }
        let (r, _) = self.node.driver().write(offset, sector, false).await;
        r?;
        if zero_len > 0 {
            self.node
                .driver()
                .write_zeroes(offset + self.sector_size, zero_len, false)
                .await?;
        }
        if entry.flags & format::FLUSH != 0 || seq.is_multiple_of(self.update_interval) {
            self.rewrite_superblock(seq).await?;
        }
        Ok(())
    }

    /// Writes the superblock with the entries counted now and flushes the log, unless a
    /// rewrite since entry `seq` was taken has counted it already.
    async fn rewrite_superblock(&self, seq: u64) -> io::Result<()> {
        let _one = self.rewriting.lock(0, 1).await;
        if self.counted.load(SeqCst) >= seq {
            return Ok(());
        }
        let entries = self.at.lock().unwrap_or_else(|p| p.into_inner()).entries;
        let sb = Superblock::new(entries, self.sector_size as u32).to_sector();
        let mut buf = new_buf(sb.len());
        buf.copy_from_slice(&sb);
        let (r, _) = self.node.driver().write(0, buf, false).await;
        r?;
        self.node.driver().flush().await?;
        self.counted.fetch_max(entries, SeqCst);
        Ok(())
    }
}

/// `len` bytes at `offset` of `node`, read while the node opens (zeroes past its end, as
/// QEMU's generic layer reads them).
fn read_at(node: &Arc<BlockNode>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let have = node.size().saturating_sub(offset).min(len as u64) as usize;
    let mut out = vec![0u8; len];
    if have == 0 {
        return Ok(out);
    }
    let n = node.clone();
    let b = crate::block::helper_thread::block_on_helper(move || async move {
        let (r, b) = n.driver().read(offset, new_buf(have)).await;
        r.map(|()| b.to_vec())
    })
    .and_then(|r| r)?;
    out[..have].copy_from_slice(&b);
    Ok(out)
}
