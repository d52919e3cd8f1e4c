//! Commands that edit open images and their links in place, with QEMU's checks in its
//! order and words: `change-backing-file` (the name an image's header gives its backing
//! file, the graph left as it is), `x-blockdev-amend` (a driver's [`AmendDef`] as an
//! `amend` job), internal snapshots (`blockdev-snapshot-internal-sync` and its delete:
//! qcow2's, see `block::qcow2::internal`; the caller holds the exports, as QEMU drains)
//! and `x-blockdev-change` (adding or removing a child of a node that takes any number of
//! them: QEMU's quorum, which stord has not, so every node refuses as QEMU's other
//! drivers do).
//!
//! [`AmendDef`]: crate::block::driver_def::AmendDef

use std::sync::Arc;

use super::error::{invalid, DaemonError};
use super::state::State;
use crate::block::node::block_node::BlockNode;

/// Whether `image` is `top` or below it through backing links and filters (QEMU's
/// bdrv_chain_contains).
fn chain_contains(top: &Arc<BlockNode>, image: &Arc<BlockNode>) -> bool {
    Arc::ptr_eq(top, image)
        || crate::block::drivers::copy_before_write::block_copy::reads_through(top, image)
}

/// QEMU's error when the snapshot list cannot be had (bdrv_snapshot_find_by_id_and_name):
/// a qcow2 image with an external data file refuses internal snapshots this way.
fn snapshot_list_failed(e: &std::io::Error) -> DaemonError {
    invalid(format!(
        "Failed to get a snapshot list: {}",
        crate::sys::os_text(e)
    ))
}

impl State {
    /// `change-backing-file`: `image_node_name` (in `device`'s chain) names
    /// `backing_file` in its header from now on, with its own format as the backing
    /// format, as QEMU writes it; a read-only image is made writable for the write.
    pub fn change_backing_file(
        &mut self,
        device: &str,
        image_node_name: &str,
        backing_file: &str,
    ) -> Result<(), DaemonError> {
        let top = self.device_node(device)?;
        if !self.parents_of(&top.name).is_empty() {
            return Err(invalid("Need a root block node"));
        }
        let image = self.find_node("", image_node_name)?;
        if image.backing_depth() == 0 {
            return Err(invalid(
                "not allowing backing file change on an image without a backing file",
            ));
        }
        top.check_not_busy()?;
        if !chain_contains(&top, &image) {
            return Err(invalid(format!(
                "'{device}' and image file are not in the same chain"
            )));
        }
        let reopened =
            crate::block::node::read_only_again::ReadOnlyAgain::new(self.make_writable(&image)?);
        let (node, name) = (image.clone(), backing_file.to_string());
        let r = crate::block::helper_thread::block_on_helper(move || async move {
            let format = node.driver_name();
            node.driver()
                .change_backing_file(Some((&name, Some(format))))
                .await
        })
        .and_then(|r| r);
        drop(reopened);
        r.map_err(|e| {
            invalid(format!(
                "Could not change backing file to '{backing_file}': {}",
                crate::sys::os_text(&e)
            ))
        })
    }

    /// A root node by QEMU's qmp_get_root_bs.
    pub(super) fn root_node(&self, device: &str) -> Result<Arc<BlockNode>, DaemonError> {
        let n = self.device_node(device)?;
        if !self.parents_of(&n.name).is_empty() {
            return Err(invalid("Need a root block node"));
        }
        Ok(n)
    }

    /// `blockdev-snapshot-internal-sync`: the node `device` (a root) gets snapshot
    /// `name`, dated now.
    pub fn snapshot_internal(
        &mut self,
        device: &str,
        name: &str,
    ) -> Result<crate::block::node::block_node::SnapshotInfo, DaemonError> {
        let node = self.root_node(device)?;
        node.check_not_busy()?;
        if node.is_read_only() {
            return Err(invalid(format!("Device '{device}' is read only")));
        }
        if !node.driver().can_snapshot() {
            return Err(invalid(format!(
                "Block format '{}' used by device '{device}' does not support internal \
                 snapshots",
                node.driver_name()
            )));
        }
        if name.is_empty() {
            return Err(invalid("Name is empty"));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // QEMU takes the time in microseconds.
        let date = (now.as_secs() as u32, now.subsec_micros() * 1000);
        let (n, name_owned) = (node.clone(), name.to_string());
        let r = crate::block::helper_thread::block_on_helper(move || async move {
            let list = match n.driver().list_snapshots().await {
                Ok(list) => list,
                Err(e) => return Ok(Err(Some(e))),
            };
            if list.iter().any(|s| s.name == name_owned) {
                return Ok(Err(None));
            }
            n.driver().create_snapshot(&name_owned, date).await.map(Ok)
        })
        .and_then(|r| r);
        match r {
            Ok(Ok(info)) => Ok(info),
            Ok(Err(None)) => Err(invalid(format!(
                "Snapshot with name '{name}' already exists on device '{device}'"
            ))),
            Ok(Err(Some(e))) => Err(snapshot_list_failed(&e)),
            Err(e) => Err(invalid(format!(
                "Failed to create snapshot '{name}' on device '{device}': {}",
                crate::sys::os_text(&e)
            ))),
        }
    }

    /// `blockdev-snapshot-delete-internal-sync`: what the deleted snapshot was.
    pub fn snapshot_delete_internal(
        &mut self,
        device: &str,
        id: Option<&str>,
        name: Option<&str>,
    ) -> Result<crate::block::node::block_node::SnapshotInfo, DaemonError> {
        let node = self.root_node(device)?;
        if id.is_none() && name.is_none() {
            return Err(invalid("Name or id must be provided"));
        }
        node.check_not_busy()?;
        let (n, i, nm) = (
            node.clone(),
            id.map(str::to_string),
            name.map(str::to_string),
        );
        let r = crate::block::helper_thread::block_on_helper(move || async move {
            // Looked up first, as QEMU's bdrv_snapshot_find_by_id_and_name.
            if let Err(e) = n.driver().list_snapshots().await {
                return Ok(Err(e));
            }
            n.driver()
                .delete_snapshot(i.as_deref(), nm.as_deref())
                .await
                .map(Ok)
        })
        .and_then(|r| r);
        match r {
            Ok(Err(e)) => Err(snapshot_list_failed(&e)),
            Ok(Ok(Some(info))) => Ok(info),
            Ok(Ok(None)) => Err(invalid(format!(
                "Snapshot with id '{}' and name '{}' does not exist on device '{device}'",
                id.unwrap_or("null"),
                name.unwrap_or("null")
            ))),
            Err(e) => Err(invalid(format!(
                "Failed to delete snapshot: {}",
                crate::sys::os_text(&e)
            ))),
        }
    }

    /// `x-blockdev-set-iothread`: node `name` and the nodes below it belong to
    /// IoThread `iothread` (None: the main loop) from now on, so exports added on them
    /// run there (QEMU's bdrv_try_change_aio_context). QEMU's checks and words; a node
    /// with an export already running is refused even with `force` (QEMU would move the
    /// export's clients; stord does not move a running export).
    pub fn set_node_iothread(
        &mut self,
        name: &str,
        iothread: Option<&str>,
        force: bool,
    ) -> Result<(), DaemonError> {
        let node = self
            .nodes
            .get(name)
            .cloned()
            .ok_or_else(|| invalid(format!("Failed to find node with node-name='{name}'")))?;
        let exported = |n: &Arc<BlockNode>| self.exports().any(|e| Arc::ptr_eq(&e.node(), n));
        if !force && (exported(&node) || node.has_job_backend()) {
            return Err(invalid(format!(
                "Node {name} is associated with a BlockBackend and could be in use (use \
                 force=true to override this check)"
            )));
        }
        if let Some(id) = iothread {
            if self.iothread(id).is_none() {
                return Err(invalid(format!("Cannot find iothread {id}")));
            }
        }
        let mut subtree = vec![node];
        let mut i = 0;
        while i < subtree.len() {
            let children: Vec<_> = subtree[i].children().into_iter().map(|(_, c)| c).collect();
            subtree.extend(children);
            i += 1;
        }
        // A job follows its node (its next copies run on the new thread, those in flight
        // finish where they started), as QEMU's job BlockBackends allow the change; an
        // export stays on the thread it was made on.
        if subtree.iter().any(exported) {
            return Err(invalid("Cannot change iothread of active block backend"));
        }
        for n in subtree {
            n.set_home(iothread.map(str::to_string));
        }
        self.jobs.node_moved();
        Ok(())
    }

    /// `x-blockdev-amend`: `options` (checked against the driver's members) applied to
    /// node `node_name` by job `job_id`.
    pub fn blockdev_amend(
        &mut self,
        job_id: &str,
        node_name: &str,
        options: serde_json::Map<String, serde_json::Value>,
        force: bool,
    ) -> Result<(), DaemonError> {
        let node = self.find_node("", node_name)?;
        let driver = options.get("driver").and_then(|d| d.as_str()).unwrap_or("");
        if node.driver_name() != driver {
            return Err(invalid(
                "x-blockdev-amend doesn't support changing the block driver",
            ));
        }
        let Some(def) = crate::block::drivers::driver(driver).and_then(|d| d.amend) else {
            return Err(invalid("Driver does not support x-blockdev-amend"));
        };
        let work = (def.prepare)(&node, &options, force, &*self).map_err(invalid)?;
        let opts = crate::job::JobOptions::plain(true, false);
        self.jobs
            .start(job_id, "amend", opts, &self.events, move |job| async move {
                job.set_progress(0, 1);
                let r = work.await;
                job.set_progress(1, 1);
                r.map(|()| None)
            })?;
        Ok(())
    }

    /// `x-blockdev-change`: removes `parent`'s child `child` or adds node `node` to it.
    pub fn blockdev_change(
        &mut self,
        parent: &str,
        child: Option<&str>,
        node: Option<&str>,
    ) -> Result<(), DaemonError> {
        let p = self.find_node(parent, parent)?;
        match (child, node) {
            (Some(_), Some(_)) => Err(invalid("The parameters child and node are in conflict")),
            (None, None) => Err(invalid("Either child or node must be specified")),
            (Some(c), None) => {
                if !p.children().iter().any(|(role, _)| *role == c) {
                    return Err(invalid(format!(
                        "Node '{parent}' does not have child '{c}'"
                    )));
                }
                Err(invalid(format!(
                    "The node {} does not support removing a child",
                    p.name
                )))
            }
            (None, Some(n)) => {
                if !self.nodes.contains_key(n) {
                    return Err(invalid(format!("Node '{n}' not found")));
                }
                Err(invalid(format!(
                    "The node {} does not support adding a child",
                    p.name
                )))
            }
        }
    }
}
