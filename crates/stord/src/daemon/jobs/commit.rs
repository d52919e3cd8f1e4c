//! `block-commit` over the graph: `top` and `base` found as QEMU finds them, its checks in
//! its order and words, and what the job holds. A commit below the active layer copies
//! into the base and re-points the overlay ([`crate::job::commit`]); a commit of the
//! active layer is a mirror into the base that moves the exports there once completed
//! (QEMU's commit_active_start, [`crate::job::mirror`]).

use std::cell::RefCell;
use std::rc::Weak;
use std::sync::Arc;

use super::backing_chain::{backing_name, chain};
use super::mirror::ExportParents;
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::state::State;
use crate::job::commit::Commit;
use crate::job::mirror::{Mirror, Scope, TargetStart, DEFAULT_BUF_SIZE};
use crate::job::on_error::OnError;
use crate::job::options::Holds;
use crate::job::write_blocking::WriteBlocking;

/// `block-commit`'s arguments.
pub struct CommitOptions {
    pub job_id: Option<String>,
    pub device: String,
    pub base_node: Option<String>,
    pub base: Option<String>,
    pub top_node: Option<String>,
    pub top: Option<String>,
    pub backing_file: Option<String>,
    pub backing_mask_protocol: bool,
    pub speed: i64,
    pub on_error: OnError,
    pub filter_node_name: Option<String>,
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
}

/// What a commit job below the active layer holds: it reads the committed images
/// (`committed`, top first) and, as QEMU's, leaves their permissions to the op blockers
/// (their overlays' claims pass down what the overlays' users share); the base must take
/// writes. `dev` is the node the job is attached to.
fn commit_holds(
    dev: &Arc<BlockNode>,
    committed: &[(Arc<BlockNode>, u32)],
    base: &Arc<BlockNode>,
    job_id: &str,
) -> Result<Holds, DaemonError> {
    let user = format!("commit job '{job_id}'");
    let reason = "block device is in use by block job: commit".to_string();
    let mut claims = Vec::new();
    let mut blockers = Vec::new();
    for (n, _) in committed {
        claims.push(n.claim(&user, "intermediate node", Perm::CONSISTENT_READ, Perm::ALL)?);
        blockers.push(n.block_ops(reason.clone())?);
    }
    claims.push(base.claim(
        &user,
        "base",
        Perm::CONSISTENT_READ | Perm::WRITE | Perm::RESIZE,
        Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED,
    )?);
    blockers.push(base.block_ops(reason)?);
    Ok(Holds {
        claims,
        blockers,
        attached: dev.attach_job(),
        reopened: Default::default(),
    })
}

/// What QEMU refuses of a commit whose top is the active layer (`top` 0) or has a writer.
fn check_active_commit(o: &CommitOptions, top: usize) -> Result<(), DaemonError> {
    if o.backing_file.is_some() {
        return Err(invalid(if top == 0 {
            "'backing-file' specified, but 'top' is the active layer"
        } else {
            "'backing-file' specified, but 'top' has a writer on it"
        }));
    }
    if top != 0 {
        return Err(invalid(
            "block-commit of an image with a writer that is not the active layer \
             is not supported by stord",
        ));
    }
    Ok(())
}

/// The image right above `top` in `above` (the chain's part above it) that has `top` as
/// its backing node: the overlay a commit re-points.
fn overlay_of(
    above: &[(Arc<BlockNode>, u32)],
    top: &Arc<BlockNode>,
) -> Result<Arc<BlockNode>, DaemonError> {
    above
        .iter()
        .rev()
        .find(|(n, _)| {
            n.children()
                .iter()
                .any(|(r, c)| *r == "backing" && Arc::ptr_eq(c, top))
        })
        .map(|(n, _)| n.clone())
        .ok_or_else(|| invalid("the image above 'top' has no backing link to it"))
}

impl State {
    /// `block-commit`: the images from `top` to just above `base` are copied into `base`,
    /// then the overlay of `top` backs onto `base` (QEMU's checks in its order, its
    /// texts); of the active layer, a mirror into `base` (`active_commit`).
    pub fn block_commit(
        &mut self,
        o: CommitOptions,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        let Some(dev) = self.nodes.get(&o.device).cloned() else {
            return Err(DaemonError::DeviceNotFound(o.device.clone()));
        };
        if !self.parents_of(&dev.name).is_empty() || dev.has_job() {
            return Err(invalid("Need a root block node"));
        }
        dev.check_not_busy()?;
        let chain = chain(&dev);
        let (top, base) = self.commit_range(&o, &chain)?;
        for (n, _) in &chain[top..base] {
            n.check_not_busy()?;
        }
        if top == base {
            return Err(invalid("cannot commit an image into itself"));
        }
        let (top_node, top_depth) = chain[top].clone();
        if top == 0 || top_node.cumulative_perms().0.contains(Perm::WRITE) {
            check_active_commit(&o, top)?;
            return self.active_commit(o, chain, base, me);
        }
        if o.filter_node_name.is_some() {
            return Err(invalid(
                "block-commit: 'filter-node-name' is not supported by stord yet",
            ));
        }
        let job = self.new_block_job(o.job_id.as_deref(), o.speed)?;
        let base_node = chain[base].0.clone();
        // QEMU reopens a read-only base read-write for the commit, and back after it.
        let reopened = crate::block::node::read_only_again::ReadOnlyAgain::new(
            self.make_writable(&base_node)?,
        );
        let overlay = overlay_of(&chain[..top], &top_node)?;
        let mut holds = commit_holds(&dev, &chain[top..base], &base_node, &job.id)?;
        holds.reopened = reopened;
        let removed: Vec<String> = chain[top..base]
            .iter()
            .map(|(n, _)| n.name.clone())
            .collect();
        let commit = Commit {
            holds,
            overlay,
            top: top_node,
            base_depth: chain[base].1 - top_depth + 1,
            backing: backing_name(&base_node, o.backing_file.clone(), o.backing_mask_protocol),
            base: base_node,
            on_error: o.on_error,
        };
        let how = (o.auto_finalize, o.auto_dismiss);
        self.start_copy_job(job, "commit", how, commit, removed, me)
    }

    /// The indexes in `chain` of the top image committed and of the base (QEMU's lookups
    /// of `top-node`/`top` and `base-node`/`base`, in its order and words).
    fn commit_range(
        &self,
        o: &CommitOptions,
        chain: &[(Arc<BlockNode>, u32)],
    ) -> Result<(usize, usize), DaemonError> {
        let position = |n: &Arc<BlockNode>| chain.iter().position(|(c, _)| Arc::ptr_eq(c, n));
        let by_file = |from: usize, f: &str| {
            chain
                .iter()
                .skip(from)
                .position(|(n, _)| n.filename().as_deref() == Some(f))
                .map(|i| i + from)
        };
        let top = match (&o.top_node, &o.top) {
            (Some(_), Some(_)) => {
                return Err(invalid("'top-node' and 'top' are mutually exclusive"))
            }
            (Some(t), None) => {
                let n = self.lookup_node(t)?;
                position(&n)
                    .ok_or_else(|| invalid(format!("'{t}' is not in this backing file chain")))?
            }
            (None, Some(t)) => {
                by_file(0, t).ok_or_else(|| invalid(format!("Top image file {t} not found")))?
            }
            (None, None) => 0,
        };
        let base = match (&o.base_node, &o.base) {
            (Some(_), Some(_)) => {
                return Err(invalid("'base-node' and 'base' are mutually exclusive"))
            }
            (Some(b), None) => {
                let n = self.lookup_node(b)?;
                match position(&n) {
                    Some(i) if i >= top => i,
                    _ => return Err(invalid(format!("'{b}' is not in this backing file chain"))),
                }
            }
            (None, Some(b)) => by_file(top, b)
                .ok_or_else(|| invalid(format!("Can't find '{b}' in the backing chain")))?,
            // The bottom of the chain.
            (None, None) => match chain.len() {
                1 => return Err(invalid("There is no backimg image")),
                n => n - 1,
            },
        };
        Ok((top, base))
    }

    /// Commit of the active layer (QEMU's commit_active_start): a mirror from `device`
    /// into the base that, once completed, moves the exports of `device` to the base.
    fn active_commit(
        &mut self,
        o: CommitOptions,
        chain: Vec<(Arc<BlockNode>, u32)>,
        base: usize,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        if o.filter_node_name.is_some() {
            return Err(invalid(
                "block-commit: 'filter-node-name' is not supported by stord yet",
            ));
        }
        let job = self.new_block_job(o.job_id.as_deref(), o.speed)?;
        let top = chain[0].0.clone();
        let (base_node, base_depth) = chain[base].clone();
        // QEMU reopens a read-only base read-write for the commit, and back after it
        // unless the exports moved onto it.
        let reopened = crate::block::node::read_only_again::ReadOnlyAgain::new(
            self.make_writable(&base_node)?,
        );
        let user = format!("commit job '{}'", job.id);
        let reason = "block device is in use by block job: commit".to_string();
        let mut claims = Vec::new();
        let mut blockers = Vec::new();
        for (n, _) in &chain[..base] {
            claims.push(n.claim(
                &user,
                "source",
                Perm::CONSISTENT_READ,
                Perm::ALL & Perm::RESIZE.complement(),
            )?);
            blockers.push(n.block_ops(reason.clone())?);
        }
        // As QEMU's mirror_start_job for a backing target: resize only if the base must
        // grow to the top's size; others may do all but resize.
        let grow = base_node.size() < top.size();
        let target_claim = base_node.claim(
            &user,
            "target",
            if grow {
                Perm::WRITE | Perm::RESIZE
            } else {
                Perm::WRITE
            },
            Perm::ALL & Perm::RESIZE.complement(),
        )?;
        blockers.push(base_node.block_ops(reason)?);
        let granularity = base_node.default_bitmap_granularity().max(4096);
        let mirror = Mirror {
            active: Arc::new(WriteBlocking::new(false, granularity, base_node.clone())),
            granularity,
            buf_size: DEFAULT_BUF_SIZE,
            source: top.clone(),
            target_attached: base_node.attach_job(),
            target: base_node,
            scope: Scope::AboveBase(base_depth),
            unmap: true,
            target_start: TargetStart::Unknown,
            on_source_error: o.on_error,
            on_target_error: o.on_error,
            target_claim,
            holds: Holds {
                claims,
                blockers,
                attached: top.attach_job_through_filter(),
                reopened,
            },
            parents: Box::new(ExportParents(me)),
        };
        self.start_block_job(
            job,
            "commit",
            (o.auto_finalize, o.auto_dismiss),
            true,
            |job| crate::job::mirror::run(mirror, job),
        )
    }
}
