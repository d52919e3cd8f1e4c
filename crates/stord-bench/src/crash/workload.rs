//! The write workloads, each a guest that drives one qcow2 node over NBD (and QMP for the
//! metadata operations a guest cannot ask for), one request at a time, recording every
//! request in the model and, after every flush it is answered, how many entries the log
//! then held: the flush's durable point in the log.

use std::io;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::log;
use super::model::{sector_bytes, Model, SECTOR};
use super::nbd::Nbd;
use super::points::Rng;
use crate::qmp::Qmp;

/// A workload: how its image is made, and the guest's requests.
pub struct Workload {
    pub name: &'static str,
    /// `qemu-img create -o` options for the image.
    pub create: &'static str,
    pub size: u64,
    pub run: fn(&mut Guest) -> io::Result<()>,
    /// Where the guest writes: the logged image, or an image a job copies into it.
    pub source: Source,
}

/// The image the guest's export writes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The logged image itself (node `disk`).
    Logged,
    /// Another image (node `src`, not logged) that a job copies into the logged one.
    Apart,
    /// An image above the logged one (node `src`, its backing `disk`), committed into it.
    Above,
}

pub const WORKLOADS: &[Workload] = &[
    Workload {
        name: "alloc",
        create: "",
        size: 64 << 20,
        run: alloc,
        source: Source::Logged,
    },
    Workload {
        name: "reftable-grow",
        create: "cluster_size=512,refcount_bits=64",
        size: 16 << 20,
        run: reftable_grow,
        source: Source::Logged,
    },
    Workload {
        name: "subclusters",
        create: "extended_l2=on",
        size: 32 << 20,
        run: subclusters,
        source: Source::Logged,
    },
    Workload {
        name: "discard",
        create: "",
        size: 32 << 20,
        run: discard,
        source: Source::Logged,
    },
    Workload {
        name: "internal-snapshot",
        create: "",
        size: 32 << 20,
        run: internal_snapshot,
        source: Source::Logged,
    },
    Workload {
        name: "persistent-bitmap",
        create: "",
        size: 32 << 20,
        run: persistent_bitmap,
        source: Source::Logged,
    },
    Workload {
        name: "mirror-target",
        create: "",
        size: 32 << 20,
        run: mirror_target,
        source: Source::Apart,
    },
    Workload {
        name: "backup-target",
        create: "",
        size: 32 << 20,
        run: backup_target,
        source: Source::Apart,
    },
    Workload {
        name: "commit-base",
        create: "",
        size: 32 << 20,
        run: commit_base,
        source: Source::Above,
    },
];

/// A client flush: requests numbered below `durable` are durable once the log's first
/// `entries` entries are.
#[derive(Clone, Copy, Debug)]
pub struct ClientFlush {
    pub durable: u32,
    pub entries: u64,
}

/// An internal snapshot: it holds the requests numbered below `frozen`; it is durable with
/// the log's first `durable_at` entries, and the log's first `deleted_at` entries come
/// before its deletion began.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub name: String,
    pub frozen: u32,
    pub durable_at: u64,
    pub deleted_at: u64,
}

/// What a guest did, for the checker.
#[derive(Default)]
pub struct Record {
    pub model: Model,
    pub flushes: Vec<ClientFlush>,
    pub snapshot: Option<Snapshot>,
    /// The persistent bitmap the image must hold once the daemon closed it.
    pub bitmap: Option<String>,
    /// A backup's point in time: the logged image holds what the requests numbered below
    /// it wrote (or zeroes, where the job had not copied yet), and once closed exactly that.
    pub frozen: Option<u32>,
}

/// The guest of one workload.
pub struct Guest {
    nbd: Nbd,
    qmp: Qmp,
    log: PathBuf,
    rng: Rng,
    sectors: u64,
    rec: Record,
    /// Whether a flush makes writes durable in the logged image (not while a job copies
    /// them from the source there).
    counting: bool,
}

impl Guest {
    pub fn new(nbd: Nbd, qmp: Qmp, log: &Path, seed: u64) -> Guest {
        let sectors = nbd.size / SECTOR;
        Guest {
            nbd,
            qmp,
            log: log.to_path_buf(),
            rng: Rng::new(seed),
            sectors,
            rec: Record::default(),
            counting: true,
        }
    }

    pub fn write(&mut self, first: u64, n: u64) -> io::Result<()> {
        let op = self.rec.model.begin();
        self.rec.model.wrote(op, first, n);
        let data: Vec<u8> = (first..first + n)
            .flat_map(|s| sector_bytes(s, op))
            .collect();
        self.nbd.write(first * SECTOR, &data)
    }

    pub fn zero(&mut self, first: u64, n: u64) -> io::Result<()> {
        let op = self.rec.model.begin();
        self.rec.model.zeroed(op, first, n);
        self.nbd.write_zeroes(first * SECTOR, (n * SECTOR) as u32)
    }

    pub fn trim(&mut self, first: u64, n: u64) -> io::Result<()> {
        let op = self.rec.model.begin();
        self.rec.model.discarded(op, first, n);
        self.nbd.trim(first * SECTOR, (n * SECTOR) as u32)
    }

    /// A flush, and the log's length once it is answered.
    pub fn flush(&mut self) -> io::Result<()> {
        self.nbd.flush()?;
        if !self.counting {
            return Ok(());
        }
        self.rec.flushes.push(ClientFlush {
            durable: self.rec.model.next_op + 1,
            entries: log::count(&self.log)?,
        });
        Ok(())
    }

    pub fn log_entries(&self) -> io::Result<u64> {
        log::count(&self.log)
    }

    /// A QMP command on the disk node.
    pub fn qmp(&mut self, cmd: &str, args: Value) -> io::Result<Value> {
        self.qmp.execute(cmd, args)
    }

    /// `n` sectors at a random place aligned to `align` sectors, within the first `span`.
    fn place(&mut self, span: u64, align: u64, n: u64) -> u64 {
        let slots = (span.min(self.sectors) - n) / align;
        self.rng.below(slots + 1) * align
    }

    /// Random writes of up to `max` sectors aligned to `align`, a flush every `every`.
    fn scatter(
        &mut self,
        ops: usize,
        span: u64,
        align: u64,
        max: u64,
        every: usize,
    ) -> io::Result<()> {
        for i in 1..=ops {
            let n = 1 + self.rng.below(max);
            let at = self.place(span, align, n);
            self.write(at, n)?;
            if i % every == 0 {
                self.flush()?;
            }
        }
        self.flush()
    }

    /// Reads the whole disk back and checks it against the model (the live image, before
    /// any crash): sectors that differ, described.
    pub fn read_back(&mut self) -> io::Result<Vec<String>> {
        let mut raw = Vec::with_capacity(self.nbd.size as usize);
        let chunk = 1 << 20;
        for at in (0..self.nbd.size).step_by(chunk) {
            let n = (self.nbd.size - at).min(chunk as u64) as u32;
            raw.extend(self.nbd.read(at, n)?);
        }
        Ok(self.rec.model.check(&raw, u32::MAX, u32::MAX).1)
    }

    /// Ends the guest: its connection closed; what it did, and the monitor.
    pub fn quit(self) -> (Record, Qmp) {
        self.nbd.disconnect();
        (self.rec, self.qmp)
    }
}

/// Clusters allocated all over the image, some overwritten.
fn alloc(g: &mut Guest) -> io::Result<()> {
    g.scatter(120, u64::MAX, 8, 64, 6)
}

/// 512-byte clusters with 64-bit refcounts: a refcount block covers 32 KiB, the first
/// refcount table 2 MiB, so writing 3 MiB grows the table (and moves it) more than once.
fn reftable_grow(g: &mut Guest) -> io::Result<()> {
    for i in 0..200u64 {
        let at = i * 32 + g.rng.below(8);
        g.write(at, 32)?;
        if i % 10 == 9 {
            g.flush()?;
        }
    }
    g.flush()
}

/// Extended L2 entries: writes and zeroes smaller than a cluster, at any sector, so
/// subclusters are allocated, zeroed and discarded one by one.
fn subclusters(g: &mut Guest) -> io::Result<()> {
    let span = 4 << 11; // 4 MiB: clusters touched again and again
    for i in 1..=150 {
        let n = 1 + g.rng.below(12);
        let at = g.place(span, 1, n);
        match g.rng.below(6) {
            0 => g.zero(at, n)?,
            1 => {
                let at = g.place(span, 4, 4);
                let n = 4 * (1 + g.rng.below(32));
                g.trim(at, n)?;
            }
            _ => g.write(at, n)?,
        }
        if i % 5 == 0 {
            g.flush()?;
        }
    }
    g.flush()
}

/// Clusters written, then discarded and zeroed (whole and in part) and written again, so
/// freed clusters are reused.
fn discard(g: &mut Guest) -> io::Result<()> {
    for c in 0..96 {
        g.write(c * 128, 128)?;
    }
    g.flush()?;
    for i in 1..=90 {
        let at = g.place(96 * 128, 8, 1);
        let (kind, k) = (g.rng.below(4), 1 + g.rng.below(64));
        match kind {
            0 => g.trim(at, 128 * (1 + k % 4))?,
            1 => g.zero(at, 8 * k)?,
            2 => g.trim(at, 8)?,
            _ => g.write(at, 8 * (1 + k % 16))?,
        }
        if i % 4 == 0 {
            g.flush()?;
        }
    }
    g.flush()
}

/// An internal snapshot taken between writes, the same clusters written again (copy on
/// write), the snapshot deleted and its clusters reused.
fn internal_snapshot(g: &mut Guest) -> io::Result<()> {
    let span = 8 << 11;
    g.scatter(40, span, 8, 32, 8)?;
    let frozen = g.rec.model.next_op + 1;
    g.qmp(
        "blockdev-snapshot-internal-sync",
        json!({"device": "disk", "name": "s1"}),
    )?;
    g.flush()?;
    let durable_at = g.log_entries()?;
    g.scatter(40, span, 8, 32, 8)?;
    let deleted_at = g.log_entries()?;
    g.rec.snapshot = Some(Snapshot {
        name: "s1".into(),
        frozen,
        durable_at,
        deleted_at,
    });
    g.qmp(
        "blockdev-snapshot-delete-internal-sync",
        json!({"device": "disk", "name": "s1"}),
    )?;
    g.flush()?;
    g.scatter(40, span * 2, 8, 32, 8)
}

/// A persistent dirty bitmap added, the image written, and the bitmap stored as the
/// daemon closes the image.
fn persistent_bitmap(g: &mut Guest) -> io::Result<()> {
    g.qmp(
        "block-dirty-bitmap-add",
        json!({"node": "disk", "name": "b0", "persistent": true}),
    )?;
    g.rec.bitmap = Some("b0".into());
    g.scatter(60, u64::MAX, 8, 64, 6)
}

/// Whether job `id` is still listed, and whether it is ready.
fn job(g: &mut Guest, id: &str) -> io::Result<Option<bool>> {
    let jobs = g.qmp("query-block-jobs", json!({}))?;
    Ok(jobs
        .as_array()
        .into_iter()
        .flatten()
        .find(|j| j["device"] == id)
        .map(|j| j["ready"] == true))
}

/// Writes, a few milliseconds apart (up to 30 of them), while `until` says the job goes
/// on (at most 20 s).
fn write_while(g: &mut Guest, until: &dyn Fn(Option<bool>) -> bool) -> io::Result<()> {
    for i in 0..2000 {
        if !until(job(g, "j")?) {
            return Ok(());
        }
        if i < 30 {
            let n = 8 * (1 + g.rng.below(8));
            let at = g.place(u64::MAX, 8, n);
            g.write(at, n)?;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let jobs = g.qmp("query-block-jobs", json!({}))?;
    Err(io::Error::other(format!(
        "the job did not finish in 20 s: {jobs}"
    )))
}

/// The image mirrored into the logged one while the guest writes to the source, then the
/// job completed (the guest's export now writes the logged image): before that, each
/// sector holds zero or something the guest wrote there; after the guest's first flush,
/// everything it wrote.
fn mirror_target(g: &mut Guest) -> io::Result<()> {
    let mirror = json!({"job-id": "j", "device": "src", "target": "disk", "sync": "full",
                        "speed": 4 << 20});
    copied_then_pivoted(g, "blockdev-mirror", mirror)
}

/// The image above the logged one committed into it (QEMU's active commit, a mirror into
/// the backing image) while the guest writes to it, then completed: as a mirror target.
fn commit_base(g: &mut Guest) -> io::Result<()> {
    let commit = json!({"job-id": "j", "device": "src", "speed": 4 << 20});
    copied_then_pivoted(g, "block-commit", commit)
}

/// Writes, the job `cmd` started, more writes while it copies, the job completed once
/// ready, then writes that reach the logged image through the same export.
fn copied_then_pivoted(g: &mut Guest, cmd: &str, args: Value) -> io::Result<()> {
    g.counting = false;
    g.scatter(40, u64::MAX, 8, 64, 8)?;
    g.qmp(cmd, args)?;
    write_while(g, &|j| j == Some(false))?;
    g.qmp("block-job-complete", json!({"device": "j"}))?;
    write_while(g, &|j| j.is_some())?;
    g.counting = true;
    g.scatter(40, u64::MAX, 8, 64, 8)
}

/// A full backup (32 MiB/s: it copies the whole disk, zeroes included) of the source into
/// the logged image while the guest writes to the source: the image gets the source as it was when the job began, never a later write.
fn backup_target(g: &mut Guest) -> io::Result<()> {
    g.counting = false;
    g.scatter(40, u64::MAX, 8, 64, 8)?;
    g.rec.frozen = Some(g.rec.model.next_op + 1);
    g.qmp(
        "blockdev-backup",
        json!({"job-id": "j", "device": "src", "target": "disk", "sync": "full",
               "speed": 32 << 20}),
    )?;
    write_while(g, &|j| j.is_some())?;
    g.scatter(20, u64::MAX, 8, 64, 8)
}
