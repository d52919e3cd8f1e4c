//! Creating and deleting internal snapshots, as QEMU's qcow2_snapshot_create and
//! qcow2_snapshot_delete do, with the metadata's write-back order (see `writeback`):
//!
//! - create: every cluster the active L1 table reaches (its L2 tables and their data)
//!   gets one more reference and loses its COPIED flag; a copy of the L1 table is
//!   written; those are durable before a new snapshot table is written and the header
//!   names it in one write; the old table's clusters are freed last. A crash before the
//!   header write leaves counts too high (leaks `qemu-img check -r leaks` repairs), never
//!   a snapshot whose clusters are not counted.
//! - delete: the header first names a table without the snapshot; then its L1 table's
//!   clusters lose a reference (those nothing else counts are free), and the active
//!   image's entries whose clusters it alone counts again get their COPIED flag back.
//!
//! The caller makes sure no request is inside the node meanwhile (QEMU drains it).

use std::io;

use super::bytes::{be32, be64, decode_be64};
use super::driver::{corrupt, Meta, MetaKind, Qcow2Driver};
use super::snapshot::{self, Entry, SnapshotL1};
use super::table::{Mapping, COPIED, OFFSET_MASK};
use crate::block::node::block_node::{BlockDriver, SnapshotInfo};

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what)
}

/// The header's `nb_snapshots` (u32), followed by `snapshots_offset` (u64).
const SNAPSHOTS_FIELD: u64 = 60;

impl Entry {
    fn info(&self) -> SnapshotInfo {
        let large = self.extra.get(..8).map(|b| be64(b, 0));
        SnapshotInfo {
            id: self.id.clone(),
            name: self.name.clone(),
            vm_state_size: large.unwrap_or(u64::from(self.vm_state_size)),
            date_sec: u64::from(self.date_sec),
            date_nsec: u64::from(self.date_nsec),
            vm_clock_nsec: self.vm_clock_nsec,
            icount: self.icount(),
        }
    }
}

impl Qcow2Driver {
    /// The snapshot table as the header names it now: its entries, where it is and how
    /// long.
    async fn read_snapshots(&self) -> io::Result<(Vec<Entry>, u64, u64)> {
        let h = self.file_read(0, 72).await?;
        let (n, off) = (be32(&h, SNAPSHOTS_FIELD as usize), be64(&h, 64));
        if n == 0 {
            return Ok((Vec::new(), 0, 0));
        }
        let mut want = 4096u64;
        loop {
            let buf = self.file_read(off, want as usize).await?;
            match snapshot::parse(&buf, n).map_err(invalid)? {
                snapshot::Parsed::Done(_, len) => {
                    let entries = snapshot::entries(&buf[..len as usize], n).map_err(invalid)?;
                    return Ok((entries, off, len));
                }
                snapshot::Parsed::NeedMore(more) if more <= snapshot::MAX_TABLE_BYTES => {
                    want = more.max(want * 2).min(snapshot::MAX_TABLE_BYTES);
                }
                snapshot::Parsed::NeedMore(_) => {
                    return Err(invalid("snapshot table too large".into()));
                }
            }
        }
    }

    /// The internal snapshots.
    pub(super) async fn list_snapshots_impl(&self) -> io::Result<Vec<SnapshotInfo>> {
        self.refuse_snapshots()?;
        let _m = self.meta.lock().await;
        Ok(self
            .read_snapshots()
            .await?
            .0
            .iter()
            .map(Entry::info)
            .collect())
    }

    /// Makes `entries` the snapshot table (the old one at `old`, `old_len` bytes long).
    async fn write_snapshot_table(
        &self,
        m: &mut Meta,
        entries: &[Entry],
        (old, old_len): (u64, u64),
    ) -> io::Result<()> {
        let cs = self.cluster_size;
        let bytes = snapshot::serialize(entries);
        let new = if bytes.is_empty() {
            0
        } else {
            let off = self
                .alloc_contiguous(m, (bytes.len() as u64).div_ceil(cs))
                .await?;
            m.add_region(
                self.cluster_bits,
                off,
                bytes.len() as u64,
                MetaKind::Snapshots,
            );
            self.file_write(off, &bytes).await?;
            off
        };
        // What the new table counts on is durable before the header names it.
        self.write_back(m).await?;
        self.file.driver().flush().await?;
        let mut field = [0u8; 12];
        field[..4].copy_from_slice(&(entries.len() as u32).to_be_bytes());
        field[4..].copy_from_slice(&new.to_be_bytes());
        self.file_write(SNAPSHOTS_FIELD, &field).await?;
        self.file.driver().flush().await?;
        m.needs_sync = false;
        if old_len > 0 {
            for c in (old / cs)..(old + old_len).div_ceil(cs) {
                m.regions.remove(&c);
                self.change_refcount(m, c * cs, -1).await?;
            }
        }
        Ok(())
    }

    /// The host clusters a mapping occupies.
    fn clusters_of(&self, map: Mapping) -> Vec<u64> {
        let cs = self.cluster_size;
        match map {
            Mapping::Data { host, .. }
            | Mapping::Zero {
                host: Some(host), ..
            } => vec![host],
            Mapping::Compressed { offset, len } if len > 0 => ((offset / cs)
                ..(offset + len).div_ceil(cs))
                .map(|c| c * cs)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Adds `delta` to the refcount of every cluster L1 table `l1` reaches; with `delta`
    /// +1 on the active table, its entries lose their COPIED flag.
    async fn count_tree(&self, m: &mut Meta, l1: &[u64], delta: i64) -> io::Result<()> {
        let codec = self.entries();
        for &e1 in l1 {
            let l2_off = e1 & OFFSET_MASK;
            if l2_off == 0 {
                continue;
            }
            self.load_l2(m, l2_off).await?;
            let table = m.l2.get(l2_off).expect("just loaded").clone();
            // With extended entries each entry's bitmap follows it.
            for e in table.iter().step_by(codec.words()) {
                let map = codec.decode(*e).map_err(corrupt)?;
                for host in self.clusters_of(map) {
                    if self.change_refcount(m, host, delta).await? == 0 {
                        // Nothing references it now: free for data.
                        m.regions.remove(&(host >> self.cluster_bits));
                    }
                }
            }
            if self.change_refcount(m, l2_off, delta).await? == 0 {
                m.regions.remove(&(l2_off >> self.cluster_bits));
                m.l2.remove(l2_off);
            }
        }
        Ok(())
    }

    /// Sets the active tables' COPIED flags from the refcounts (QEMU's
    /// qcow2_update_snapshot_refcount with addend 0): set where the cluster is counted
    /// once, cleared elsewhere.
    async fn refresh_copied(&self, m: &mut Meta) -> io::Result<()> {
        let codec = self.entries();
        for i in 0..m.l1.len() {
            let l2_off = m.l1[i] & OFFSET_MASK;
            if l2_off == 0 {
                continue;
            }
            let one = self.change_refcount(m, l2_off, 0).await? == 1;
            let e1 = if one {
                m.l1[i] | COPIED
            } else {
                m.l1[i] & !COPIED
            };
            if e1 != m.l1[i] {
                m.l1[i] = e1;
                m.l1_dirty.insert(i);
            }
            self.load_l2(m, l2_off).await?;
            let mut table = m.l2.get(l2_off).expect("just loaded").clone();
            let mut changed = false;
            for e in table.iter_mut().step_by(codec.words()) {
                let host = match codec.decode(*e).map_err(corrupt)? {
                    Mapping::Data { host, .. }
                    | Mapping::Zero {
                        host: Some(host), ..
                    } => host,
                    _ => continue,
                };
                let one = self.change_refcount(m, host, 0).await? == 1;
                let new = if one { *e | COPIED } else { *e & !COPIED };
                if new != *e {
                    *e = new;
                    changed = true;
                }
            }
            if changed {
                *m.l2.get_mut(l2_off).expect("loaded") = table;
            }
        }
        Ok(())
    }

    /// Takes snapshot `name` of the active image (QEMU's id: one past the highest).
    pub(super) async fn create_snapshot_impl(
        &self,
        name: &str,
        (date_sec, date_nsec): (u32, u32),
    ) -> io::Result<SnapshotInfo> {
        self.refuse_snapshots()?;
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        self.write_back(&mut m).await?;
        self.sync_if_needed(&mut m).await?;
        let (mut entries, old, old_len) = self.read_snapshots().await?;
        if entries.len() as u32 >= snapshot::MAX_SNAPSHOTS {
            return Err(invalid("Too many snapshots".into()));
        }
        let id = entries
            .iter()
            .filter_map(|e| e.id.parse::<u64>().ok())
            .max()
            .map_or(1, |n| n + 1)
            .to_string();
        // Everything the active image reaches is shared with the snapshot from now on.
        let l1 = m.l1.clone();
        self.count_tree(&mut m, &l1, 1).await?;
        self.refresh_copied(&mut m).await?;
        let cs = self.cluster_size;
        let l1_bytes: Vec<u8> = m.l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        let l1_off = if l1_bytes.is_empty() {
            0
        } else {
            let off = self
                .alloc_contiguous(&mut m, (l1_bytes.len() as u64).div_ceil(cs))
                .await?;
            m.add_region(
                self.cluster_bits,
                off,
                l1_bytes.len() as u64,
                MetaKind::InactiveL1,
            );
            self.file_write(off, &l1_bytes).await?;
            off
        };
        let mut extra = Vec::with_capacity(snapshot::EXTRA_LEN);
        extra.extend(0u64.to_be_bytes());
        extra.extend(self.size().to_be_bytes());
        extra.extend(u64::MAX.to_be_bytes());
        entries.push(Entry {
            l1: SnapshotL1 {
                offset: l1_off,
                entries: m.l1.len() as u32,
            },
            id,
            name: name.to_string(),
            date_sec,
            date_nsec,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            extra,
        });
        self.write_snapshot_table(&mut m, &entries, (old, old_len))
            .await?;
        self.write_back(&mut m).await?;
        self.sync_if_needed(&mut m).await?;
        Ok(entries.last().expect("just pushed").info())
    }

    /// Deletes the snapshot with `id` and/or `name` (QEMU's find_snapshot_by_id_and_name):
    /// what it was, or None if there is none.
    pub(super) async fn delete_snapshot_impl(
        &self,
        id: Option<&str>,
        name: Option<&str>,
    ) -> io::Result<Option<SnapshotInfo>> {
        self.refuse_snapshots()?;
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        let (mut entries, old, old_len) = self.read_snapshots().await?;
        let Some(i) = entries
            .iter()
            .position(|e| id.is_none_or(|id| e.id == id) && name.is_none_or(|n| e.name == n))
        else {
            return Ok(None);
        };
        self.write_back(&mut m).await?;
        self.sync_if_needed(&mut m).await?;
        let gone = entries.remove(i);
        self.write_snapshot_table(&mut m, &entries, (old, old_len))
            .await?;
        let n = gone.l1.entries as usize;
        let l1: Vec<u64> = if n == 0 {
            Vec::new()
        } else {
            let buf = self.file_read(gone.l1.offset, n * 8).await?;
            decode_be64(&buf)
        };
        self.count_tree(&mut m, &l1, -1).await?;
        let cs = self.cluster_size;
        if n > 0 {
            let first = gone.l1.offset / cs;
            for c in first..(gone.l1.offset + n as u64 * 8).div_ceil(cs) {
                m.regions.remove(&c);
                self.change_refcount(&mut m, c * cs, -1).await?;
            }
        }
        self.refresh_copied(&mut m).await?;
        self.write_back(&mut m).await?;
        self.sync_if_needed(&mut m).await?;
        Ok(Some(gone.info()))
    }
}
