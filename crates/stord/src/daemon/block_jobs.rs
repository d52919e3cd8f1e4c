//! Block jobs over the graph: the daemon resolves a job's nodes by QEMU's rules (its
//! checks in its order, its texts), takes the permissions and op blockers the job holds
//! while it runs, and hands the work to [`crate::job`].

use std::cell::RefCell;
use std::future::Future;
use std::rc::Weak;
use std::sync::Arc;

use super::{invalid, DaemonError, State};
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::block::node::perm::Perm;
use crate::job::commit::Commit;
use crate::job::home::Home;
use crate::job::mirror::{Mirror, Parents, Scope, TargetStart, DEFAULT_BUF_SIZE};
use crate::job::stream::Stream;
use crate::job::write_blocking::WriteBlocking;
use crate::job::{run_copy, CopyJob, Finish, Holds, Job, JobOptions, OnError};

/// `block-stream`'s arguments.
pub struct StreamOptions {
    pub job_id: Option<String>,
    pub device: String,
    /// A backing file name in the chain (QEMU's `base`).
    pub base: Option<String>,
    pub base_node: Option<String>,
    pub backing_file: Option<String>,
    pub backing_mask_protocol: bool,
    pub bottom: Option<String>,
    pub speed: i64,
    pub on_error: OnError,
    pub filter_node_name: Option<String>,
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
}

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

/// `blockdev-mirror`'s arguments.
pub struct MirrorOptions {
    pub job_id: Option<String>,
    pub device: String,
    pub target: String,
    pub replaces: Option<String>,
    /// `full`, `top` or `none`.
    pub sync: String,
    pub speed: i64,
    pub granularity: Option<i64>,
    pub buf_size: Option<i64>,
    pub on_source_error: OnError,
    pub on_target_error: OnError,
    pub filter_node_name: Option<String>,
    /// `background` or `write-blocking`.
    pub copy_mode: Option<String>,
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
    /// The target is an image just created (drive-mirror): it reads as zeroes.
    pub target_fresh: bool,
}

/// The exports a mirror moves, reached through the daemon while the job runs.
struct ExportParents(Weak<RefCell<State>>);

impl Parents for ExportParents {
    fn links_on(&self, node: &Arc<BlockNode>) -> Vec<Arc<NodeLink>> {
        self.0
            .upgrade()
            .map(|s| s.borrow().export_links_on(node))
            .unwrap_or_default()
    }

    fn home_of(&self, node: &Arc<BlockNode>) -> Option<Home> {
        home_of(&self.0, node)
    }

    fn replace(
        &self,
        links: &[Arc<NodeLink>],
        from: &Arc<BlockNode>,
        to: &Arc<BlockNode>,
    ) -> Result<(), String> {
        match self.0.upgrade() {
            Some(s) => s
                .borrow_mut()
                .repoint_exports(from, to, Some(links))
                .map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

/// The thread that serves `node` now: where a job's loop and copies run. None when the
/// daemon's state is in use by a command that waits on the loop meanwhile (look again).
fn home_of(me: &Weak<RefCell<State>>, node: &Arc<BlockNode>) -> Option<Home> {
    let Some(state) = me.upgrade() else {
        return Some(Home::Main);
    };
    let state = state.try_borrow().ok()?;
    Some(
        state
            .iothread_serving(node)
            .map_or(Home::Main, Home::IoThread),
    )
}

/// Asks, each time it is called, which thread serves `node` (a job's loop follows a node
/// moved to another IoThread while the job runs).
pub(super) fn home_finder(
    me: Weak<RefCell<State>>,
    node: Arc<BlockNode>,
) -> impl Fn() -> Option<Home> {
    move || home_of(&me, &node)
}

/// A block job QEMU has announced by now (created): one that fails before it starts is
/// announced gone (null) as it is dropped, as QEMU's job_early_fail, before the command's
/// error goes out.
pub(super) struct NewJob {
    pub(super) id: String,
    speed: u64,
    /// Made inside a drained section (a transaction action's): see
    /// [`JobOptions::drained`].
    pub(super) drained: bool,
    /// The states announced when it goes unstarted: QEMU's job_early_fail (created,
    /// null), or a transaction's abort cancelling it (created, aborting, ...).
    pub(super) gone_as: &'static [&'static str],
    /// Where the early failure is announced; None once the job has started.
    events: Option<crate::events::Events>,
}

impl NewJob {
    /// The job started: nothing to announce on drop.
    fn started(mut self) {
        self.events = None;
    }
}

impl Drop for NewJob {
    fn drop(&mut self) {
        if let Some(events) = self.events.take() {
            for &status in self.gone_as {
                events.emit(
                    "JOB_STATUS_CHANGE",
                    serde_json::json!({ "status": status, "id": self.id }),
                );
            }
        }
    }
}

/// The chain below `top` as bdrv_filter_or_cow_bs walks it, `top` first, each node with
/// its depth as allocation_depth counts it (top is 1; a backing link adds one, a
/// filter's file link none).
fn chain(top: &Arc<BlockNode>) -> Vec<(Arc<BlockNode>, u32)> {
    let mut out = vec![(top.clone(), 1)];
    let mut depth = 1;
    let mut n = top.clone();
    while let Some(next) = n.filtered_or_backing() {
        if n.children()
            .iter()
            .any(|(role, c)| *role == "backing" && Arc::ptr_eq(c, &next))
        {
            depth += 1;
        }
        out.push((next.clone(), depth));
        n = next;
        if out.len() > 4096 {
            break;
        }
    }
    out
}

/// The name and format an image's header gives `base` as its backing file: `given`, else
/// the path of the first non-filter node (QEMU's bdrv_skip_filters and `filename`), and
/// its driver (a protocol driver as `raw` with `mask_protocol`).
fn backing_name(
    base: &Arc<BlockNode>,
    given: Option<String>,
    mask_protocol: bool,
) -> (String, String) {
    let mut unfiltered = base.clone();
    while unfiltered.driver_name() == "throttle" {
        match unfiltered.filtered_or_backing() {
            Some(n) => unfiltered = n,
            None => break,
        }
    }
    let fmt = match unfiltered.driver_name() {
        "file" | "host_device" if mask_protocol => "raw",
        f => f,
    };
    (
        given.or_else(|| unfiltered.filename()).unwrap_or_default(),
        fmt.to_string(),
    )
}

/// An argument's name and whether it was given.
type Given<'a> = (&'a str, bool);

/// QEMU's refusal of two arguments given together that exclude each other, checked in the
/// order given.
fn exclusive(pairs: &[(Given<'_>, Given<'_>)]) -> Result<(), DaemonError> {
    match pairs.iter().find(|((_, a), (_, b))| *a && *b) {
        Some(((a, _), (b, _))) => Err(invalid(format!(
            "'{a}' and '{b}' cannot be specified at the same time"
        ))),
        None => Ok(()),
    }
}

/// What a stream job holds: it writes unchanged data into `top`, where nobody may resize;
/// the nodes it removes from the chain (`streamed` past the top) must not change under
/// it, and none of `streamed` may be used by another job.
fn stream_holds(
    top: &Arc<BlockNode>,
    streamed: &[(Arc<BlockNode>, u32)],
    job_id: &str,
) -> Result<Holds, DaemonError> {
    let user = format!("stream job '{job_id}'");
    let mut claims = vec![top.claim(
        &user,
        "active node",
        Perm::WRITE_UNCHANGED,
        Perm::ALL & Perm::RESIZE.complement(),
    )?];
    let mut blockers = Vec::new();
    let reason = "block device is in use by block job: stream".to_string();
    for (i, (n, _)) in streamed.iter().enumerate() {
        if i > 0 {
            claims.push(n.claim(
                &user,
                "intermediate node",
                Perm::NONE,
                Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED,
            )?);
        }
        blockers.push(n.block_ops(reason.clone())?);
    }
    Ok(Holds {
        claims,
        blockers,
        attached: top.attach_job(),
        reopened: Default::default(),
    })
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
    /// A node by QEMU's bdrv_lookup_bs(device, node): stord's nodes have no device
    /// names, so either name may match a node-name (QEMU's text otherwise).
    pub(super) fn find_node(
        &self,
        device: &str,
        node: &str,
    ) -> Result<Arc<BlockNode>, DaemonError> {
        self.nodes
            .get(node)
            .or_else(|| self.nodes.get(device))
            .cloned()
            .ok_or_else(|| {
                invalid(format!(
                    "Cannot find device='{device}' nor node-name='{node}'"
                ))
            })
    }

    fn lookup_node(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.find_node("", name)
    }

    /// A node named as both device and node (QEMU's lookups of a `device` argument).
    pub(super) fn device_node(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.find_node(name, name)
    }

    /// A new block job's id (QEMU names one without an id after the device, which has no
    /// name in a storage daemon: refused) and speed (a negative one is refused after QEMU
    /// announced the job, created then gone).
    pub(super) fn new_block_job(
        &self,
        id: Option<&str>,
        speed: i64,
    ) -> Result<NewJob, DaemonError> {
        let id = id.unwrap_or_default().to_string();
        self.jobs.check_new(&id)?;
        let mut job = NewJob {
            id,
            speed: 0,
            drained: false,
            gone_as: &["created", "null"],
            events: Some(self.events.clone()),
        };
        job.speed = u64::try_from(speed)
            .map_err(|_| invalid("Parameter 'speed' expects a non-negative value"))?;
        Ok(job)
    }

    /// `block-stream`: the content of the chain between `device` and its base is copied
    /// into `device`, then `device`'s backing link skips it (QEMU's checks and texts).
    pub fn block_stream(
        &mut self,
        o: StreamOptions,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        exclusive(&[
            (
                ("base", o.base.is_some()),
                ("base-node", o.base_node.is_some()),
            ),
            (("base", o.base.is_some()), ("bottom", o.bottom.is_some())),
            (
                ("bottom", o.bottom.is_some()),
                ("base-node", o.base_node.is_some()),
            ),
        ])?;
        let top = self.device_node(&o.device)?;
        let chain = chain(&top);
        let end = self.stream_end(&o, &chain)?;
        for (n, _) in &chain[..end] {
            n.check_not_busy()?;
        }
        let base = chain.get(end).map(|(n, _)| n.clone());
        if base.is_none() && o.backing_file.is_some() {
            return Err(invalid(
                "backing file specified, but streaming the entire chain",
            ));
        }
        if o.filter_node_name.is_some() {
            return Err(invalid(
                "block-stream: 'filter-node-name' is not supported by stord yet",
            ));
        }
        let job = self.new_block_job(o.job_id.as_deref(), o.speed)?;
        if top.is_read_only() {
            return Err(invalid(format!(
                "Block node '{}' is read-only: stord streams only into a writable node",
                top.name
            )));
        }
        let holds = stream_holds(&top, &chain[..end], &job.id)?;
        let removed: Vec<String> = chain[1..end].iter().map(|(n, _)| n.name.clone()).collect();
        let stream = Stream {
            holds,
            base_depth: base.as_ref().map(|_| chain[end].1),
            backing: base
                .as_ref()
                .map(|b| backing_name(b, o.backing_file.clone(), o.backing_mask_protocol)),
            top,
            base,
            on_error: o.on_error,
        };
        let how = (o.auto_finalize, o.auto_dismiss);
        self.start_copy_job(job, "stream", how, stream, removed, me)
    }

    /// Where the streamed part of `chain` ends: the index of the base, as `base` (a file
    /// name), `base-node` or `bottom` names it (chain.len() when everything below the top
    /// comes up).
    fn stream_end(
        &self,
        o: &StreamOptions,
        chain: &[(Arc<BlockNode>, u32)],
    ) -> Result<usize, DaemonError> {
        let position = |n: &Arc<BlockNode>| chain.iter().position(|(c, _)| Arc::ptr_eq(c, n));
        if let Some(b) = &o.base {
            return chain
                .iter()
                .skip(1)
                .position(|(n, _)| n.filename().as_deref() == Some(b.as_str()))
                .map(|i| i + 1)
                .ok_or_else(|| invalid(format!("Can't find '{b}' in the backing chain")));
        }
        if let Some(b) = &o.base_node {
            let base = self.lookup_node(b)?;
            return match position(&base) {
                Some(i) if i > 0 => Ok(i),
                _ => Err(invalid(format!(
                    "Node '{b}' is not a backing image of '{}'",
                    o.device
                ))),
            };
        }
        if let Some(b) = &o.bottom {
            let bottom = self.lookup_node(b)?;
            if matches!(bottom.driver_name(), "throttle") {
                return Err(invalid(format!(
                    "Node '{b}' is a filter, use a non-filter node as 'bottom'"
                )));
            }
            return position(&bottom).map(|i| i + 1).ok_or_else(|| {
                invalid(format!(
                    "Node '{b}' is not in a chain starting from '{}'",
                    o.device
                ))
            });
        }
        Ok(chain.len())
    }

    /// Starts a copying block job; the nodes in `removed` go once its graph change is done
    /// and nothing uses them, as QEMU frees nodes with their last reference.
    fn start_copy_job<T: CopyJob>(
        &mut self,
        job: NewJob,
        kind: &'static str,
        how: (bool, bool),
        work: T,
        removed: Vec<String>,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        let home = home_finder(me.clone(), work.node().clone());
        self.start_block_job(job, kind, how, false, move |job| {
            run_copy(work, job, home, move || {
                if let Some(state) = me.upgrade() {
                    state.borrow_mut().drop_implicit(removed);
                }
            })
        })
    }

    /// Starts block job `job`; `completable`: it waits in ready for job-complete.
    pub(super) fn start_block_job<F>(
        &mut self,
        new: NewJob,
        kind: &'static str,
        (auto_finalize, auto_dismiss): (bool, bool),
        completable: bool,
        work: impl FnOnce(Arc<Job>) -> F,
    ) -> Result<(), DaemonError>
    where
        F: Future<Output = Result<Finish, String>> + 'static,
    {
        let opts = JobOptions {
            auto_finalize,
            auto_dismiss,
            block: true,
            speed: new.speed,
            completable,
            drained: new.drained,
        };
        self.jobs.start(&new.id, kind, opts, &self.events, work)?;
        new.started();
        Ok(())
    }

    /// `block-commit`: the images from `top` to just above `base` are copied into `base`,
    /// then the overlay of `top` backs onto `base` (QEMU's checks in its order, its
    /// texts); of the active layer, a mirror into `base` ([`Self::active_commit`]).
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

    /// `blockdev-mirror`: `device`'s content is copied to `target` while clients write;
    /// ready once in step, and on `job-complete` the exports of `device` move to `target`.
    pub fn blockdev_mirror(
        &mut self,
        o: MirrorOptions,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        self.mirror_then(o, me, None)
    }

    /// A mirror, and `after` once it has ended (see [`with_after`]).
    pub(super) fn mirror_then(
        &mut self,
        o: MirrorOptions,
        me: Weak<RefCell<State>>,
        after: Option<Box<dyn FnOnce()>>,
    ) -> Result<(), DaemonError> {
        let source = self.device_node(&o.device)?;
        if !self.parents_of(&source.name).is_empty() || source.has_job() {
            return Err(invalid("Need a root block node"));
        }
        let target = self.device_node(&o.target)?;
        let mut scope = mirror_scope(&o)?;
        source.check_not_busy()?;
        target.check_not_busy()?;
        if scope == Scope::Top && source.backing_depth() == 0 {
            scope = Scope::Full;
        }
        check_mirror_support(&o)?;
        if Arc::ptr_eq(&source, &target) {
            return Err(invalid("Can't mirror node into itself"));
        }
        let job = self.new_block_job(o.job_id.as_deref(), o.speed)?;
        if target.is_read_only() {
            return Err(invalid(format!(
                "Block node '{}' is read-only",
                target.name
            )));
        }
        let (holds, target_claim) = mirror_holds(&source, &target, &job.id)?;
        let granularity = match o.granularity {
            Some(g) if g > 0 => g as u64,
            _ => target.default_bitmap_granularity().clamp(4096, 65536),
        };
        let blocking = o.copy_mode.as_deref() == Some("write-blocking");
        // As QEMU's mirror_dirty_init: a target is zeroed first only if zeroes may unmap
        // there (`discard=unmap`); else every byte is copied.
        let target_start = if o.target_fresh {
            TargetStart::ReadsZero
        } else if target.unmaps() {
            TargetStart::ZeroFirst
        } else {
            TargetStart::Unknown
        };
        let mirror = Mirror {
            active: Arc::new(WriteBlocking::new(blocking, granularity, target.clone())),
            granularity,
            // As QEMU's mirror_start_job: a whole number of granules.
            buf_size: match o.buf_size {
                Some(b) if b > 0 => (b as u64).div_ceil(granularity) * granularity,
                _ => DEFAULT_BUF_SIZE,
            },
            source,
            target_attached: target.attach_job(),
            target,
            scope,
            unmap: true,
            target_start,
            on_source_error: o.on_source_error,
            on_target_error: o.on_target_error,
            target_claim,
            holds,
            parents: Box::new(ExportParents(me)),
        };
        self.start_block_job(
            job,
            "mirror",
            (o.auto_finalize, o.auto_dismiss),
            true,
            |job| with_after(crate::job::mirror::run(mirror, job), after),
        )
    }
}

/// Runs a closure when dropped.
pub(super) struct OnDrop(pub(super) Option<Box<dyn FnOnce()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A job's `work`, and `after` once the work and its finalize are done and dropped,
/// however the job ends (also if it is cancelled before it ever runs).
pub(super) fn with_after<F>(
    work: F,
    after: Option<Box<dyn FnOnce()>>,
) -> impl Future<Output = Result<Finish, String>>
where
    F: Future<Output = Result<Finish, String>> + 'static,
{
    let guard = OnDrop(after);
    async move {
        match work.await {
            Ok(Some(finish)) => {
                let finish: std::pin::Pin<Box<dyn Future<Output = Result<(), String>>>> =
                    Box::pin(async move {
                        let r = finish.await;
                        drop(guard);
                        r
                    });
                Ok(Some(finish))
            }
            other => {
                drop(guard);
                other
            }
        }
    }
}

/// A mirror's `sync` as the part of the chain it copies, after QEMU's checks of
/// `granularity` and `buf-size` (in its order and words).
fn mirror_scope(o: &MirrorOptions) -> Result<Scope, DaemonError> {
    let scope = match o.sync.as_str() {
        "full" => Scope::Full,
        "top" => Scope::Top,
        "none" => Scope::None,
        other => {
            return Err(invalid(format!(
                "blockdev-mirror: sync mode '{other}' is not supported by stord"
            )))
        }
    };
    if let Some(g) = o.granularity {
        if g != 0 && !(512..=64 << 20).contains(&g) {
            return Err(invalid(
                "Parameter 'granularity' expects a value in range [512B, 64MB]",
            ));
        }
        if g & (g - 1) != 0 {
            return Err(invalid("Parameter 'granularity' expects a power of 2"));
        }
    }
    if o.buf_size.is_some_and(|b| b < 0) {
        return Err(invalid("Parameter 'buf-size' expects a non-negative value"));
    }
    Ok(scope)
}

/// The mirror options QEMU takes that stord does not do yet.
fn check_mirror_support(o: &MirrorOptions) -> Result<(), DaemonError> {
    if o.replaces.as_ref().is_some_and(|r| *r != o.device) {
        return Err(invalid(
            "blockdev-mirror: 'replaces' naming another node than 'device' is not \
             supported by stord",
        ));
    }
    if o.filter_node_name.is_some() {
        return Err(invalid(
            "blockdev-mirror: 'filter-node-name' is not supported by stord yet",
        ));
    }
    Ok(())
}

/// What a mirror holds: the source is read (nobody may resize it), the target written
/// (others may only read it or write what it holds); neither may serve another job.
fn mirror_holds(
    source: &Arc<BlockNode>,
    target: &Arc<BlockNode>,
    job_id: &str,
) -> Result<(Holds, crate::block::node::block_node::Claim), DaemonError> {
    let user = format!("mirror job '{job_id}'");
    let reason = "block device is in use by block job: mirror".to_string();
    let claims = vec![source.claim(
        &user,
        "source",
        Perm::CONSISTENT_READ,
        Perm::ALL & Perm::RESIZE.complement(),
    )?];
    let target_claim = target.claim(
        &user,
        "target",
        Perm::WRITE,
        Perm::WRITE_UNCHANGED | Perm::CONSISTENT_READ,
    )?;
    let blockers = vec![source.block_ops(reason.clone())?, target.block_ops(reason)?];
    let holds = Holds {
        claims,
        blockers,
        attached: source.attach_job_through_filter(),
        reopened: Default::default(),
    };
    Ok((holds, target_claim))
}
