//! Inactive nodes: QEMU 10's hand-over of an image between two daemons on shared storage
//! (a migration's source and destination). An inactive node reads, writes nothing (its
//! requests fail with EPERM), holds no lock on its file and lets its children be written
//! by others; `--blockdev ...,active=off` opens one, `blockdev-set-active` switches nodes
//! (one with its children, or all), in QEMU's order and words.
//!
//! Going inactive, a node first writes and flushes what it caches, then its exports let
//! go of their permissions (those made with `allow-inactive=on`; any other export, or a
//! job writing, refuses the hand-over), then its children follow once no active parent
//! needs them. Going active, children come first; the node takes its locks again (the
//! other daemon must have let go) and reads its metadata afresh (a qcow2 header, tables
//! and refcounts), then its exports take their permissions back.

use std::sync::Arc;

use super::error::DaemonError;
use super::state::State;
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;

fn eperm(what: &str) -> DaemonError {
    DaemonError::Invalid(format!("{what}: Operation not permitted"))
}

impl State {
    /// `blockdev-set-active`: `node` (with its children), or every node.
    pub fn blockdev_set_active(
        &mut self,
        node: Option<&str>,
        active: bool,
    ) -> Result<(), DaemonError> {
        let Some(name) = node else {
            let mut nodes: Vec<Arc<BlockNode>> = self.nodes.values().cloned().collect();
            if active {
                for n in nodes {
                    self.activate(&n)?;
                }
            } else {
                // Roots first; their children follow them.
                nodes.retain(|n| self.parents_of(&n.name).is_empty());
                for n in nodes {
                    self.inactivate(&n)
                        .map_err(|_| eperm("Failed to inactivate all nodes"))?;
                }
            }
            return Ok(());
        };
        let Some(n) = self.nodes.get(name).cloned() else {
            return Err(DaemonError::Invalid(format!(
                "Failed to find node with node-name='{name}'"
            )));
        };
        if active {
            return self.activate(&n);
        }
        if self.has_active_parent(&n) {
            return Err(DaemonError::Invalid("Node has active parent node".into()));
        }
        self.inactivate(&n)
    }

    /// The ids of the exports that serve `n`.
    fn exports_on(&self, n: &Arc<BlockNode>) -> Vec<String> {
        self.exports
            .values()
            .filter(|e| Arc::ptr_eq(&e.node(), n))
            .map(|e| e.id().to_string())
            .collect()
    }

    fn has_active_parent(&self, n: &BlockNode) -> bool {
        self.parents_of(&n.name)
            .iter()
            .any(|(p, _)| self.nodes.get(p).is_some_and(|p| !p.is_inactive()))
    }

    /// QEMU's bdrv_inactivate_recurse.
    fn inactivate(&mut self, n: &Arc<BlockNode>) -> Result<(), DaemonError> {
        if n.is_inactive() {
            return Ok(());
        }
        if n.has_persistent_bitmaps() {
            // QEMU stores them at inactivation; stord stores them at close only, which an
            // inactive node must not do: refused rather than lost or written late.
            return Err(DaemonError::Invalid(
                "Failed to inactivate node: stord cannot hand over an image with persistent \
                 dirty bitmaps"
                    .into(),
            ));
        }
        let m = n.clone();
        crate::block::helper_thread::block_on_helper(move || async move {
            m.driver().inactivate().await
        })
        .and_then(|r| r)
        .map_err(|e| DaemonError::Invalid(format!("Failed to inactivate node: {e}")))?;
        // The exports on it: those allowed to stay give up their permissions.
        let ids = self.exports_on(n);
        for id in &ids {
            if !self.inactive_exports.contains_key(id) && !self.allow_inactive.contains(id) {
                return Err(eperm("Failed to inactivate node"));
            }
        }
        for id in ids {
            if let Some(c) = self.export_claims.get(&id) {
                let held = c.held();
                c.set(Perm::NONE, Perm::ALL)?;
                self.inactive_exports.insert(id, held);
            }
        }
        if n.cumulative_perms()
            .0
            .intersects(Perm::WRITE | Perm::WRITE_UNCHANGED)
        {
            // Another user (a job) still writes here.
            return Err(eperm("Failed to inactivate node"));
        }
        n.set_inactive(true);
        // Loosening only (its locks go, its children let others write): cannot fail.
        let _ = n.refresh_perms();
        for (_, child) in n.children() {
            if !self.has_active_parent(&child) {
                self.inactivate(&child)?;
            }
        }
        Ok(())
    }

    /// QEMU's bdrv_activate: children first, then the node's locks, its metadata read
    /// afresh, and its exports' permissions.
    fn activate(&mut self, n: &Arc<BlockNode>) -> Result<(), DaemonError> {
        for (_, child) in n.children() {
            self.activate(&child)?;
        }
        if n.is_inactive() {
            n.set_inactive(false);
            if let Err(e) = n.refresh_perms() {
                n.set_inactive(true);
                let _ = n.refresh_perms();
                return Err(e.into());
            }
            let (m, writable) = (n.clone(), !n.is_read_only());
            let r = crate::block::helper_thread::block_on_helper(move || async move {
                m.driver().invalidate_cache(writable).await
            })
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            if let Err(e) = r {
                n.set_inactive(true);
                let _ = n.refresh_perms();
                return Err(DaemonError::Invalid(format!(
                    "Could not activate node '{}': {e}",
                    n.name
                )));
            }
        }
        let ids = self.exports_on(n);
        for id in ids {
            if let (Some((perm, shared)), Some(c)) = (
                self.inactive_exports.get(&id).copied(),
                self.export_claims.get(&id),
            ) {
                c.set(perm, shared)?;
                self.inactive_exports.remove(&id);
            }
        }
        Ok(())
    }

    /// An export being added on `node`: with `allow-inactive`, it holds no permission
    /// while the node is inactive (QEMU's BlockBackend with disabled permissions);
    /// without, the node is activated first, as QEMU's blk_exp_add does.
    pub(super) fn prepare_export_node(
        &mut self,
        node: &Arc<BlockNode>,
        allow_inactive: bool,
    ) -> Result<bool, DaemonError> {
        if node.is_inactive() && !allow_inactive {
            self.activate(node)?;
        }
        Ok(node.is_inactive())
    }
}
