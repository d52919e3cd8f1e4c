//! `block-stream` over the graph: the base found as QEMU finds it (`base`, `base-node` or
//! `bottom`), its checks in its order and words, what the job holds (the top written,
//! the streamed images kept unchanged and away from other jobs), then the work
//! ([`crate::job::stream`]) started.

use std::cell::RefCell;
use std::rc::Weak;
use std::sync::Arc;

use super::backing_chain::{backing_name, chain};
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::state::State;
use crate::job::on_error::OnError;
use crate::job::options::Holds;
use crate::job::stream::Stream;

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

impl State {
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
}
