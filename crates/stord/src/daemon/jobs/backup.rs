//! blockdev-backup over the graph: QEMU's checks in its order and words
//! (blockdev.c's do_backup_common, backup.c's backup_job_create), what the job holds, and
//! the point in time: the copy set, the frozen bitmap and the copy-before-write hook are
//! made together while no export request is inside the graph (the caller holds the
//! exports, as QEMU drains). A transaction makes the backup in its prepare and starts it
//! at commit; dropped unstarted, it leaves nothing behind.

use std::sync::Arc;

use super::start::{home_finder, with_after, NewJob, OnDrop};
use crate::block::drivers::copy_before_write::block_copy::{
    reads_through, BeforeWrite, CopyBeforeWrite, PointInTimeReads, Unallocated,
};
use crate::block::node::block_node::BlockNode;
use crate::block::node::hook_on::HookOn;
use crate::block::node::perm::Perm;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::state::State;
use crate::job::backup::{Backup, BitmapMode, Sync, SyncBitmap};
use crate::job::on_error::OnError;
use crate::job::options::Holds;

/// QEMU's BLOCK_COPY_CLUSTER_SIZE_DEFAULT.
const DEFAULT_CLUSTER: u64 = 64 << 10;

/// `x-perf`'s members.
#[derive(Default)]
pub struct BackupPerf {
    pub max_workers: Option<i64>,
    pub max_chunk: Option<i64>,
    pub min_cluster_size: Option<u64>,
}

/// `blockdev-backup`'s arguments.
pub struct BackupOptions {
    pub job_id: Option<String>,
    pub device: String,
    pub target: String,
    /// `full`, `top`, `none`, `incremental` or `bitmap`.
    pub sync: String,
    pub speed: i64,
    pub bitmap: Option<String>,
    pub bitmap_mode: Option<BitmapMode>,
    pub compress: bool,
    pub on_source_error: OnError,
    pub on_target_error: OnError,
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
    pub filter_node_name: Option<String>,
    pub discard_source: bool,
    pub perf: BackupPerf,
}

/// A backup made and not started yet.
pub struct PreparedBackup {
    job: NewJob,
    work: Backup,
    how: (bool, bool),
    /// What runs once the job has ended, or when it is dropped unstarted (drive-backup
    /// lets its target go). Last: it runs after the work's hold on the nodes is gone.
    pub(super) after: OnDrop,
}

/// QEMU's desugaring of `incremental` and its checks of `bitmap` and `bitmap-mode` that
/// need no node: the sync mode and bitmap mode to use.
fn sync_modes(o: &BackupOptions) -> Result<(String, Option<BitmapMode>), DaemonError> {
    let mut sync = o.sync.clone();
    let mut mode = o.bitmap_mode;
    if matches!(sync.as_str(), "bitmap" | "incremental") && o.bitmap.is_none() {
        return Err(invalid(format!(
            "must provide a valid bitmap name for '{sync}' sync mode"
        )));
    }
    if sync == "incremental" {
        if mode.is_some_and(|m| m != BitmapMode::OnSuccess) {
            return Err(invalid(
                "Bitmap sync mode must be 'on-success' when using sync mode 'incremental'",
            ));
        }
        sync = "bitmap".into();
        mode = Some(BitmapMode::OnSuccess);
    }
    Ok((sync, mode))
}

/// The backup's cluster size (QEMU's block_copy_calculate_cluster_size).
fn cluster_size(target: &BlockNode, min: Option<u64>) -> Result<u64, DaemonError> {
    let min = min.unwrap_or(0);
    if min > i64::MAX as u64 {
        return Err(invalid(format!(
            "min-cluster-size too large: {min} > {}",
            i64::MAX
        )));
    }
    if min != 0 && !min.is_power_of_two() {
        return Err(invalid("min-cluster-size needs to be a power of 2"));
    }
    let min = min.max(DEFAULT_CLUSTER);
    Ok(match target.driver().cluster_size() {
        Some(c) => c.max(min),
        None => min,
    })
}

/// What a backup holds: the source is read (nobody may resize it), the target written
/// (others may read and write it, not resize it); neither may serve another job.
fn backup_holds(
    source: &Arc<BlockNode>,
    target: &Arc<BlockNode>,
    job_id: &str,
) -> Result<Holds, DaemonError> {
    let user = format!("backup job '{job_id}'");
    let reason = "block device is in use by block job: backup".to_string();
    let all_but_resize = Perm::ALL & Perm::RESIZE.complement();
    let claims = vec![
        source.claim(&user, "source", Perm::CONSISTENT_READ, all_but_resize)?,
        target.claim(&user, "target", Perm::WRITE, all_but_resize)?,
    ];
    let blockers = vec![source.block_ops(reason.clone())?, target.block_ops(reason)?];
    Ok(Holds {
        claims,
        blockers,
        attached: source.attach_job_through_filter(),
        reopened: Default::default(),
    })
}

/// backup_job_create's checks after the bitmap's (in QEMU's order): the backup's cluster
/// size.
fn check_backup(
    o: &BackupOptions,
    source: &Arc<BlockNode>,
    target: &Arc<BlockNode>,
    bitmap: Option<&crate::block::node::dirty_bitmap::DirtyBitmap>,
    mode: Option<BitmapMode>,
) -> Result<u64, DaemonError> {
    if Arc::ptr_eq(source, target) {
        return Err(invalid("Source and target cannot be the same"));
    }
    // QEMU names the target's device here, which a node of qsd's never has.
    if o.compress && !target.supports_compressed_writes() {
        return Err(invalid("Compression is not supported for this drive "));
    }
    source.check_not_busy()?;
    target.check_not_busy()?;
    if o.perf
        .max_workers
        .is_some_and(|w| !(1..=i32::MAX as i64).contains(&w))
    {
        return Err(invalid(format!(
            "max-workers must be between 1 and {}",
            i32::MAX
        )));
    }
    if o.perf.max_chunk.is_some_and(|c| c < 0) {
        return Err(invalid(
            "max-chunk must be zero (which means no limit) or positive",
        ));
    }
    if let (Some(b), Some(m)) = (bitmap, mode) {
        if m != BitmapMode::Never {
            b.check(crate::block::node::dirty_bitmap::Use::Modify)
                .map_err(|e| invalid(e.to_string()))?;
        }
    }
    if source.size() != target.size() {
        return Err(invalid("Source and target image have different sizes"));
    }
    for (given, what) in [
        (o.filter_node_name.is_some(), "filter-node-name"),
        (o.discard_source, "discard-source"),
    ] {
        if given {
            return Err(invalid(format!(
                "blockdev-backup: '{what}' is not supported by stord yet"
            )));
        }
    }
    let cluster = cluster_size(target, o.perf.min_cluster_size)?;
    if let Some(c) = o.perf.max_chunk.filter(|&c| c > 0 && (c as u64) < cluster) {
        return Err(invalid(format!(
            "Required max-chunk ({c}) is less than backup cluster size ({cluster})"
        )));
    }
    Ok(cluster)
}

/// The hooks that keep the point in time: copy-before-write on the source, and the held
/// reads of a target that reads through to it.
fn point_in_time_hooks(
    source: &Arc<BlockNode>,
    target: &Arc<BlockNode>,
    copy: &Arc<CopyBeforeWrite>,
) -> Vec<HookOn> {
    let mut hooks = vec![HookOn::install(source, Arc::new(BeforeWrite(copy.clone())))];
    if reads_through(target, source) {
        hooks.push(HookOn::install(
            target,
            Arc::new(PointInTimeReads(copy.clone())),
        ));
    }
    hooks
}

impl PreparedBackup {
    /// A transaction's abort: the job made in its prepare is cancelled unstarted (QEMU's
    /// job_cancel_sync of a created job: aborting, concluded, null).
    pub fn abort(mut self) {
        self.job.gone_as = &["created", "aborting", "concluded", "null"];
    }
}

impl State {
    /// `blockdev-backup` up to the start: checks, holds, and the point in time.
    pub fn blockdev_backup(&mut self, o: BackupOptions) -> Result<PreparedBackup, DaemonError> {
        let source = self.device_node(&o.device)?;
        let target = self.device_node(&o.target)?;
        let (sync, mode) = sync_modes(&o)?;
        let bitmap = self.backup_bitmap(&source, &o, &sync, mode)?;
        let cluster = check_backup(&o, &source, &target, bitmap.as_deref(), mode)?;
        self.check_hooked_paths(&source, &target)?;
        let mut job = self.new_block_job(o.job_id.as_deref(), o.speed)?;
        job.drained = true;
        let holds = backup_holds(&source, &target, &job.id)?;
        let unallocated = if sync == "top" && source.backing_depth() > 0 {
            Unallocated::Skip
        } else {
            Unallocated::Copy
        };
        let copy = Arc::new(CopyBeforeWrite::new(
            source.clone(),
            target.clone(),
            cluster,
            unallocated,
        ));
        if o.compress {
            copy.set_compress();
        }
        match &bitmap {
            Some(b) if sync == "bitmap" => mark_from(&copy, b, source.size()),
            _ => copy.mark(0, source.size()),
        }
        let bitmap = match (bitmap, mode) {
            (Some(b), Some(m)) => {
                Some(SyncBitmap::freeze(&source, b, m, copy.clone()).map_err(invalid)?)
            }
            _ => None,
        };
        let hooks = point_in_time_hooks(&source, &target, &copy);
        let work = Backup {
            copy,
            sync: if sync == "none" {
                Sync::None
            } else {
                Sync::Copy
            },
            bitmap,
            on_source_error: o.on_source_error,
            on_target_error: o.on_target_error,
            hooks,
            holds,
            target_attached: target.attach_job(),
        };
        Ok(PreparedBackup {
            job,
            work,
            how: (o.auto_finalize, o.auto_dismiss),
            after: OnDrop(None),
        })
    }

    /// The point in time is kept on the source's (and a fleecing target's) own request
    /// path: a node above that passes requests straight to it (a filter, a format over its
    /// file) would go past it. Nodes that use it as their backing image only read it.
    fn check_hooked_paths(
        &self,
        source: &Arc<BlockNode>,
        target: &Arc<BlockNode>,
    ) -> Result<(), DaemonError> {
        let mut nodes = vec![source];
        if reads_through(target, source) {
            nodes.push(target);
        }
        for n in nodes {
            if let Some((parent, role)) = self
                .parents_of(&n.name)
                .into_iter()
                .find(|(_, r)| *r != "backing")
            {
                return Err(invalid(format!(
                    "blockdev-backup: node '{}' is the {role} of node '{parent}', whose \
                     requests pass by it: stord backs up a node only from the top of its \
                     stack (back up '{parent}')",
                    n.name
                )));
            }
        }
        Ok(())
    }

    /// The bitmap a backup reads or syncs, after QEMU's checks of it (in its order).
    fn backup_bitmap(
        &self,
        source: &Arc<BlockNode>,
        o: &BackupOptions,
        sync: &str,
        mode: Option<BitmapMode>,
    ) -> Result<Option<Arc<crate::block::node::dirty_bitmap::DirtyBitmap>>, DaemonError> {
        let Some(name) = &o.bitmap else {
            if mode.is_some() {
                return Err(invalid("Cannot specify bitmap sync mode without a bitmap"));
            }
            return Ok(None);
        };
        let b = source
            .bitmap(name)
            .map_err(|_| invalid(format!("Bitmap '{name}' could not be found")))?;
        let Some(mode) = mode else {
            return Err(invalid(
                "Bitmap sync mode must be given when providing a bitmap",
            ));
        };
        b.check(crate::block::node::dirty_bitmap::Use::AllowReadOnly)
            .map_err(|e| invalid(e.to_string()))?;
        if sync == "none" {
            return Err(invalid(
                "sync mode 'none' does not produce meaningful bitmap outputs",
            ));
        }
        if mode == BitmapMode::Never && sync != "bitmap" {
            return Err(invalid(format!(
                "Bitmap sync mode 'never' has no meaningful effect when combined with sync \
                 mode '{sync}'"
            )));
        }
        Ok(Some(b))
    }

    /// Starts a prepared backup.
    /// Starts a prepared backup; its copies run where the source is served (`me`: the
    /// daemon, to find that out as the job goes).
    pub fn start_backup(
        &mut self,
        p: PreparedBackup,
        me: std::rc::Weak<std::cell::RefCell<State>>,
    ) -> Result<(), DaemonError> {
        let mut p = p;
        let after = p.after.0.take();
        let (work, job, how) = (p.work, p.job, p.how);
        let home = home_finder(me, work.copy.source.clone());
        self.start_block_job(job, "backup", how, false, move |job| {
            with_after(crate::job::backup::run(work, job, home), after)
        })
    }
}

/// Marks in `copy` what `bitmap` has dirty.
fn mark_from(
    copy: &CopyBeforeWrite,
    bitmap: &crate::block::node::dirty_bitmap::DirtyBitmap,
    size: u64,
) {
    let mut o = 0;
    while o < size {
        let (n, dirty) = bitmap.extent(o, size - o);
        if dirty {
            copy.mark(o, n);
        }
        o += n.max(1);
    }
}
