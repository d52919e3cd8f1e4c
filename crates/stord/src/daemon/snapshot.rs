//! External snapshots: `blockdev-snapshot` puts an overlay above a node that exports
//! serve (the node becomes the overlay's backing file and the exports move to the
//! overlay; the caller holds the exports' links meanwhile, see [`hold_all_exports`], so no
//! request is half done on the node when the overlay starts copying from it), and `blockdev-snapshot-sync` first creates
//! and opens that overlay. QEMU's checks in its order and its texts (external_snapshot_*).

use std::sync::Arc;

use super::error::{invalid, DaemonError};
use super::state::State;
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::cli::keyval::KeyVal;

/// `blockdev-snapshot-sync`'s arguments.
pub struct SnapshotSyncOptions {
    pub device: Option<String>,
    pub node_name: Option<String>,
    pub snapshot_file: String,
    pub snapshot_node_name: Option<String>,
    pub format: Option<String>,
    /// `mode=existing`: the image is there already.
    pub existing: bool,
}

/// A snapshot taken, as [`State::undo_snapshot`] needs it.
pub struct SnapshotDone {
    old: Arc<BlockNode>,
    overlay: Arc<BlockNode>,
    was_writable: bool,
    /// The node blockdev-snapshot-sync opened.
    created: Option<String>,
}

impl State {
    /// The checks on the node snapshotted, before the overlay is looked at: not busy, and
    /// what it holds on disk (QEMU flushes it).
    fn snapshot_prepare(&self, old: &Arc<BlockNode>) -> Result<(), DaemonError> {
        old.check_not_busy()?;
        // QEMU blocks every operation on a backing node for its overlay's sake.
        if let Some((parent, _)) = self
            .parents_of(&old.name)
            .into_iter()
            .find(|(_, role)| *role == "backing")
        {
            return Err(invalid(format!(
                "Node '{}' is busy: node is used as backing hd of '{parent}'",
                old.name
            )));
        }
        if !old.is_read_only() {
            let n = old.clone();
            let r = crate::block::helper_thread::block_on_helper(
                move || async move { n.flush().await },
            );
            if !matches!(r, Ok(Ok(()))) {
                return Err(invalid(format!("Write to node '{}' failed", old.name)));
            }
        }
        Ok(())
    }

    /// The overlay goes on top of `old` (QEMU's bdrv_append for the exports): its backing
    /// link names `old`, every export on `old` moves to it, and `old` becomes read-only.
    fn snapshot_append(
        &mut self,
        old: &Arc<BlockNode>,
        overlay: &Arc<BlockNode>,
    ) -> Result<SnapshotDone, DaemonError> {
        // A user that reads the overlay (QEMU lets a write-only one, a mirror's target, be).
        if overlay.cumulative_perms().0.contains(Perm::CONSISTENT_READ) {
            return Err(invalid("The overlay is already in use"));
        }
        if matches!(overlay.driver_name(), "throttle" | "raw")
            && overlay.filtered_or_backing().is_some()
        {
            return Err(invalid("Filters cannot be used as overlays"));
        }
        if overlay
            .children()
            .iter()
            .any(|(role, _)| *role == "backing")
        {
            return Err(invalid("The overlay already has a backing image"));
        }
        if overlay.driver_name() != "qcow2" {
            return Err(invalid("The overlay does not support backing images"));
        }
        if let Some((parent, role)) = self.parents_of(&old.name).into_iter().next() {
            return Err(invalid(format!(
                "stord cannot yet move the node parents of '{}' to an overlay ('{parent}' \
                 uses it as '{role}'): snapshot the node its exports use",
                old.name
            )));
        }
        if Arc::ptr_eq(old, overlay) {
            return Err(invalid(format!(
                "Making '{0}' a backing child of '{0}' would create a cycle",
                old.name
            )));
        }
        overlay
            .set_backing(Some(old.clone()))
            .map_err(DaemonError::Invalid)?;
        if let Err(e) = self.repoint_exports(old, overlay, None) {
            let _ = overlay.set_backing(None);
            return Err(e);
        }
        // As QEMU's external_snapshot_commit: the old node goes read-only (what fails
        // there is ignored, as in QEMU).
        let was_writable = !old.is_read_only();
        if was_writable {
            old.set_read_only(true);
            let _ = old.refresh_perms();
        }
        Ok(SnapshotDone {
            old: old.clone(),
            overlay: overlay.clone(),
            was_writable,
            created: None,
        })
    }

    /// Takes a snapshot back (a transaction's later action failed): the exports return
    /// to the node, which is writable again if it was, and the overlay loses its backing
    /// link; an overlay blockdev-snapshot-sync opened goes (its image stays, as QEMU's).
    pub fn undo_snapshot(&mut self, done: SnapshotDone) {
        if done.was_writable {
            done.old.set_read_only(false);
            let _ = done.old.refresh_perms();
        }
        if let Err(e) = self.repoint_exports(&done.overlay, &done.old, None) {
            // The exports stay on the overlay, which keeps its backing link and its place
            // in the graph: they read and write as after the snapshot.
            tracing::warn!(
                "snapshot undo: exports stay on '{}': {e}",
                done.overlay.name
            );
            if done.was_writable {
                done.old.set_read_only(true);
                let _ = done.old.refresh_perms();
            }
            return;
        }
        let _ = done.overlay.set_backing(None);
        if let Some(name) = done.created {
            drop(done.overlay);
            self.forget_node(&name);
        }
    }

    /// `blockdev-snapshot`: `overlay` (opened by blockdev-add, with no backing file) goes
    /// on top of `node`.
    pub fn blockdev_snapshot(
        &mut self,
        node: &str,
        overlay: &str,
    ) -> Result<SnapshotDone, DaemonError> {
        let old = self.find_node(node, node)?;
        self.snapshot_prepare(&old)?;
        let new = self.find_node(overlay, overlay)?;
        self.snapshot_append(&old, &new)
    }

    /// `blockdev-snapshot-sync`: creates a qcow2 overlay naming the node as its backing
    /// file (unless `mode=existing`), opens it without its backing file, then as
    /// `blockdev-snapshot`.
    pub fn blockdev_snapshot_sync(
        &mut self,
        o: SnapshotSyncOptions,
    ) -> Result<SnapshotDone, DaemonError> {
        let device = o.device.clone().unwrap_or_default();
        let node_name = o.node_name.clone().unwrap_or_default();
        let old = self.find_node(&device, &node_name)?;
        self.snapshot_prepare(&old)?;
        if o.node_name.is_some() && o.snapshot_node_name.is_none() {
            return Err(invalid("New overlay node-name missing"));
        }
        if let Some(n) = &o.snapshot_node_name {
            if self.nodes.contains_key(n) {
                return Err(invalid("New overlay node-name already in use"));
            }
        }
        let format = o.format.clone().unwrap_or_else(|| "qcow2".into());
        if format != "qcow2" {
            return Err(invalid(format!(
                "blockdev-snapshot-sync: format '{format}' is not supported by stord (qcow2 is)"
            )));
        }
        if !o.existing {
            let backing = old.filename().map(|f| (f, old.driver_name().to_string()));
            super::new_image::create_image(&o.snapshot_file, "qcow2", old.size(), backing)?;
        }
        let mut pairs = vec![
            ("driver".to_string(), format),
            ("file.driver".to_string(), "file".to_string()),
            ("file.filename".to_string(), o.snapshot_file.clone()),
            ("backing".to_string(), String::new()),
        ];
        if let Some(n) = &o.snapshot_node_name {
            pairs.push(("node-name".to_string(), n.clone()));
        }
        let name =
            self.add_blockdev_unowned(KeyVal::from_pairs("blockdev-snapshot-sync", pairs))?;
        let new = self.nodes.get(&name).cloned().expect("just added");
        match self.snapshot_append(&old, &new) {
            Ok(done) => Ok(SnapshotDone {
                created: Some(name),
                ..done
            }),
            Err(e) => {
                drop(new);
                self.forget_node(&name);
                Err(e)
            }
        }
    }
}

/// Holds the link of every export (QEMU drains everything around a snapshot): once this
/// returns, no request is inside the graph and new ones wait until the holds are dropped.
/// It waits with the main loop running (requests served there finish meanwhile), so the
/// caller must not hold the state borrowed.
pub fn hold_all_exports(state: &super::SharedState) -> Vec<crate::block::node::link::Hold> {
    let links: Vec<_> = state
        .borrow()
        .exports
        .values()
        .map(|e| e.link().clone())
        .collect();
    if links.is_empty() {
        return Vec::new();
    }
    let wait = async move {
        let mut held = Vec::new();
        for l in &links {
            held.push(l.hold().await);
        }
        held
    };
    stord_aio::with_current_context(|ctx| ctx.block_on(wait)).unwrap_or_default()
}
