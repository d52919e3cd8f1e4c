//! Block jobs over the graph: the daemon resolves a job's nodes by QEMU's rules (its
//! checks in its order, its texts), takes the permissions and op blockers the job holds
//! while it runs, and hands the work to [`crate::job`].

use std::cell::RefCell;
use std::rc::Weak;
use std::sync::Arc;

use super::{DaemonError, State};
use crate::block::perm::Perm;
use crate::block::BlockNode;
use crate::job::stream::Stream;
use crate::job::{JobOptions, OnError};

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

fn invalid(s: impl Into<String>) -> DaemonError {
    DaemonError::Invalid(s.into())
}

impl State {
    fn lookup_node(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.nodes
            .get(name)
            .cloned()
            .ok_or_else(|| invalid(format!("Cannot find device='' nor node-name='{name}'")))
    }

    /// `block-stream`: the content of the chain between `device` and its base is copied
    /// into `device`, then `device`'s backing link skips it (QEMU's checks and texts).
    pub fn block_stream(
        &mut self,
        o: StreamOptions,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        if o.base.is_some() && o.base_node.is_some() {
            return Err(invalid(
                "'base' and 'base-node' cannot be specified at the same time",
            ));
        }
        if o.base.is_some() && o.bottom.is_some() {
            return Err(invalid(
                "'base' and 'bottom' cannot be specified at the same time",
            ));
        }
        if o.bottom.is_some() && o.base_node.is_some() {
            return Err(invalid(
                "'bottom' and 'base-node' cannot be specified at the same time",
            ));
        }
        let top = self.nodes.get(&o.device).cloned().ok_or_else(|| {
            invalid(format!(
                "Cannot find device='{0}' nor node-name='{0}'",
                o.device
            ))
        })?;
        let chain = chain(&top);
        let position = |n: &Arc<BlockNode>| chain.iter().position(|(c, _)| Arc::ptr_eq(c, n));
        // Where the streamed part of the chain ends: the index of the base in `chain`
        // (chain.len() when everything below top comes up).
        let mut end = chain.len();
        if let Some(b) = &o.base {
            end = chain
                .iter()
                .skip(1)
                .position(|(n, _)| n.filename().as_deref() == Some(b.as_str()))
                .map(|i| i + 1)
                .ok_or_else(|| invalid(format!("Can't find '{b}' in the backing chain")))?;
        }
        if let Some(b) = &o.base_node {
            let base = self.lookup_node(b)?;
            end = match position(&base) {
                Some(i) if i > 0 => i,
                _ => {
                    return Err(invalid(format!(
                        "Node '{b}' is not a backing image of '{}'",
                        o.device
                    )))
                }
            };
        }
        if let Some(b) = &o.bottom {
            let bottom = self.lookup_node(b)?;
            if matches!(bottom.driver_name(), "throttle") {
                return Err(invalid(format!(
                    "Node '{b}' is a filter, use a non-filter node as 'bottom'"
                )));
            }
            end = match position(&bottom) {
                Some(i) => i + 1,
                None => {
                    return Err(invalid(format!(
                        "Node '{b}' is not in a chain starting from '{}'",
                        o.device
                    )))
                }
            };
        }
        for (n, _) in &chain[..end] {
            n.check_not_busy().map_err(|e| invalid(e.to_string()))?;
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
        let job_id = o.job_id.clone().unwrap_or_default();
        self.jobs.check_new(&job_id)?;
        let Ok(speed) = u64::try_from(o.speed) else {
            self.jobs.early_fail(&job_id, &self.events);
            return Err(invalid("Parameter 'speed' expects a non-negative value"));
        };
        if top.is_read_only() {
            return Err(invalid(format!(
                "Block node '{}' is read-only: stord streams only into a writable node",
                top.name
            )));
        }
        // The job's hold on the chain: it writes unchanged data into top, where nobody may
        // resize; the nodes it removes from the chain must not change under it.
        let user = format!("stream job '{job_id}'");
        let mut claims = vec![top.claim(
            &user,
            "active node",
            Perm::WRITE_UNCHANGED,
            Perm::ALL & Perm::RESIZE.complement(),
        )?];
        let mut blockers = Vec::new();
        let reason = "block device is in use by block job: stream".to_string();
        for (i, (n, _)) in chain[..end].iter().enumerate() {
            if i > 0 {
                claims.push(n.claim(
                    &user,
                    "intermediate node",
                    Perm::NONE,
                    Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED,
                )?);
            }
            blockers.push(
                n.block_ops(reason.clone())
                    .map_err(|e| invalid(e.to_string()))?,
            );
        }
        let base_depth = base.as_ref().map(|_| chain[end].1);
        // The name and format the image will give its new backing file.
        let backing = base.as_ref().map(|b| {
            let mut unfiltered = b.clone();
            while unfiltered.driver_name() == "throttle" {
                match unfiltered.filtered_or_backing() {
                    Some(n) => unfiltered = n,
                    None => break,
                }
            }
            let fmt = match unfiltered.driver_name() {
                "file" | "host_device" if o.backing_mask_protocol => "raw",
                f => f,
            };
            (
                o.backing_file
                    .clone()
                    .or_else(|| unfiltered.filename())
                    .unwrap_or_default(),
                fmt.to_string(),
            )
        });
        let removed: Vec<String> = chain[1..end].iter().map(|(n, _)| n.name.clone()).collect();
        let stream = Stream {
            top,
            base,
            base_depth,
            backing,
            on_error: o.on_error,
            claims,
            blockers,
        };
        let opts = JobOptions {
            auto_finalize: o.auto_finalize,
            auto_dismiss: o.auto_dismiss,
            block: true,
            speed,
            completable: false,
        };
        self.jobs
            .start(&job_id, "stream", opts, &self.events, move |job| {
                stream.run(job, move || {
                    // The nodes the chain lost go once nothing uses them, as QEMU frees
                    // them with their last reference.
                    if let Some(state) = me.upgrade() {
                        state.borrow_mut().drop_implicit(removed);
                    }
                })
            })?;
        Ok(())
    }
}
