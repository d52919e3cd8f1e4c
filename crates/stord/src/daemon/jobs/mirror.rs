//! `blockdev-mirror` over the graph: QEMU's checks of the options and nodes in its order
//! and words, what the job holds (the source read, the target written), and the exports
//! the job moves to the target when it completes, reached through the daemon while it
//! runs (`ExportParents`). The work is [`crate::job::mirror`].

use std::cell::RefCell;
use std::rc::Weak;
use std::sync::Arc;

use super::start::{home_of, with_after};
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::block::node::options::DetectZeroes;
use crate::block::node::perm::Perm;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::state::State;
use crate::job::home::Home;
use crate::job::mirror::{Mirror, Parents, Scope, TargetStart, DEFAULT_BUF_SIZE};
use crate::job::on_error::OnError;
use crate::job::options::Holds;
use crate::job::write_blocking::WriteBlocking;

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
    /// `target-is-zero` (QEMU 10.1): the caller says the target reads as zeroes.
    pub target_is_zero: bool,
}

/// The exports a mirror moves, reached through the daemon while the job runs.
pub(super) struct ExportParents(pub(super) Weak<RefCell<State>>);

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

impl State {
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
        let target_start = target_start(&o, &target);
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

/// What the target holds when a `sync=full` mirror starts, as QEMU 10.1's
/// mirror_dirty_init decides: a target that reads as zeroes (`target-is-zero`, or an image
/// drive-mirror just created) is not written where the source reads zeroes, unless its
/// `detect-zeroes=unmap` asks for holes punched; otherwise it is zeroed first if zeroes
/// may unmap there (`discard=unmap`), else every byte is copied.
fn target_start(o: &MirrorOptions, target: &BlockNode) -> TargetStart {
    let punch_holes = target.detect_zeroes() == DetectZeroes::Unmap && target.unmaps();
    if (o.target_fresh || o.target_is_zero) && !punch_holes {
        TargetStart::ReadsZero
    } else if target.unmaps() {
        TargetStart::ZeroFirst
    } else {
        TargetStart::Unknown
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
