//! The daemon's exports: `block-export-add` and `block-export-del`, the permissions an
//! export takes of its node, and the exports that follow a node when a job or a graph
//! change moves what they serve.

use std::sync::Arc;

use stord_aio::Remote;

use crate::block::node::block_node::BlockNode;
use crate::block::node::link::NodeLink;
use crate::cli::id_wellformed;
use crate::cli::keyval::KeyVal;
use crate::export::types::EXPORT_TYPES;
use crate::export::ExportEnv;

use super::error::DaemonError;
use super::state::State;

/// What an export takes of its node, as QEMU's `blk_exp_add`: reads, writes when
/// writable, resizes when growable (FUSE); others may do anything but, for NBD, resize (its
/// clients were told the size).
pub(super) fn export_perms(
    kind: &str,
    writable: bool,
    growable: bool,
) -> (
    crate::block::node::perm::Perm,
    crate::block::node::perm::Perm,
) {
    use crate::block::node::perm::Perm;
    let mut perm = Perm::CONSISTENT_READ;
    if writable {
        perm = perm | Perm::WRITE;
    }
    if growable {
        perm = perm | Perm::RESIZE;
    }
    let shared = if kind == "nbd" {
        Perm::ALL & Perm::RESIZE.complement()
    } else {
        Perm::ALL
    };
    (perm, shared)
}

impl State {
    /// `--export` / `block-export-add`: the type's constructor from [`EXPORT_TYPES`].
    pub fn add_export(&mut self, mut kv: KeyVal) -> Result<(), DaemonError> {
        let kind = kv.take_required("type")?;
        let Some(ty) = EXPORT_TYPES.iter().find(|t| t.name == kind) else {
            let names: Vec<&str> = EXPORT_TYPES.iter().map(|t| t.name).collect();
            return Err(kv.bad_value("type", &names.join(", "), &kind).into());
        };
        if let Some(id) = kv.get("id") {
            if !id_wellformed(id) {
                return Err(DaemonError::Invalid("Invalid block export id".into()));
            }
            if self.exports.contains_key(id) {
                return Err(DaemonError::ExportIdTaken(id.into()));
            }
        }
        // The export's permissions on its node come first, so a conflict refuses it before
        // it listens or mounts anything.
        let allow_inactive = kv.take_bool("allow-inactive", false)?;
        if allow_inactive && !ty.supports_inactive {
            return Err(DaemonError::Invalid(
                "Export type does not support inactive exports".into(),
            ));
        }
        let mut held_back = None;
        let claim = match kv.get("node-name").and_then(|n| self.nodes.get(n)).cloned() {
            Some(node) => {
                let writable = matches!(kv.get("writable"), Some("on" | "true" | "yes"));
                let growable = matches!(kv.get("growable"), Some("on" | "true" | "yes"));
                let (mut perm, mut shared) = export_perms(&kind, writable, growable);
                if self.prepare_export_node(&node, allow_inactive)? {
                    held_back = Some((perm, shared));
                    (perm, shared) = (
                        crate::block::node::perm::Perm::NONE,
                        crate::block::node::perm::Perm::ALL,
                    );
                }
                // An export's BlockBackend has no name in QEMU: its words for the user.
                Some(node.claim("an unnamed block device", "root", perm, shared)?)
            }
            None => None,
        };
        // A node moved to an IoThread keeps its exports there, as QEMU's exports follow
        // their node's AioContext.
        if kv.get("iothread").is_none() && kv.get("iothread.0").is_none() {
            if let Some(home) = kv.get("node-name").and_then(|n| self.nodes.get(n)?.home()) {
                kv.inherit("iothread", &home);
            }
        }
        let env = ExportEnv {
            nodes: &self.nodes,
            iothreads: &self.iothreads,
            servers: &self.servers,
            claimed: self.exports.values().filter_map(|e| e.claim()).collect(),
        };
        let export = (ty.create)(&env, kv)?;
        let id = export.id().to_string();
        if let Some(c) = claim {
            self.export_claims.insert(id.clone(), c);
        }
        if let Some(p) = held_back {
            self.inactive_exports.insert(id.clone(), p);
        }
        if allow_inactive {
            self.allow_inactive.insert(id.clone());
        }
        self.exports.insert(id, export);
        Ok(())
    }

    /// `block-export-del`: with `hard`, clients are disconnected; without, the export must
    /// have none. The export is gone (and `BLOCK_EXPORT_DELETED` sent) once the last
    /// client's requests have finished.
    pub fn del_export(&mut self, id: &str, hard: bool) -> Result<(), DaemonError> {
        let Some(e) = self.exports.get(id) else {
            return Err(DaemonError::ExportNotFound(id.into()));
        };
        if e.shutting_down() {
            return Err(DaemonError::ExportShuttingDown(id.into()));
        }
        if !hard && e.in_use() {
            return Err(DaemonError::ExportInUse(id.into()));
        }
        self.begin_export_removal(id);
        Ok(())
    }

    /// Takes the export out of the table and stops it; a main-loop task waits for its
    /// requests to finish (woken by the export, no polling), then announces and drops it.
    pub(super) fn begin_export_removal(&mut self, id: &str) {
        let Some(mut e) = self.exports.remove(id) else {
            return;
        };
        e.begin_stop();
        let claim = self.export_claims.remove(id);
        self.allow_inactive.remove(id);
        self.inactive_exports.remove(id);
        let events = self.events.clone();
        self.removals.retain(|h| !h.is_finished());
        self.removals.push(stord_aio::spawn(async move {
            std::future::poll_fn(|cx| e.poll_drained(cx)).await;
            events.emit("BLOCK_EXPORT_DELETED", serde_json::json!({ "id": e.id() }));
            drop(e);
            drop(claim);
        }));
    }

    /// The links of the exports that serve `node` now.
    pub fn export_links_on(&self, node: &Arc<BlockNode>) -> Vec<Arc<NodeLink>> {
        self.exports
            .values()
            .filter(|e| Arc::ptr_eq(&e.node(), node))
            .map(|e| e.link().clone())
            .collect()
    }

    /// The IoThread that serves `node`: the one it was moved to, else the first that one
    /// of its exports runs on (QEMU's node AioContext); None for the main loop.
    pub fn iothread_serving(&self, node: &Arc<BlockNode>) -> Option<Remote> {
        if let Some(home) = node.home() {
            return self.iothread(&home).cloned();
        }
        let serves = |r: &Remote| {
            self.exports
                .values()
                .any(|e| Arc::ptr_eq(&e.node(), node) && e.runs_on(r))
        };
        self.iothreads()
            .find(|(_, r)| serves(r))
            .map(|(_, r)| r.clone())
    }

    /// Points every export that serves `from` at `to` (QEMU's bdrv_replace_node, for the
    /// exports' root links): each export's permissions are taken on `to` before any moves,
    /// so a conflict leaves everything as it was. Requests in flight finish on `from`.
    /// `only`: just the exports with these links (those a job held and drained; an export
    /// added since stays where it is).
    pub fn repoint_exports(
        &mut self,
        from: &Arc<BlockNode>,
        to: &Arc<BlockNode>,
        only: Option<&[Arc<NodeLink>]>,
    ) -> Result<(), DaemonError> {
        let ids: Vec<String> = self
            .exports
            .values()
            .filter(|e| Arc::ptr_eq(&e.node(), from))
            .filter(|e| only.is_none_or(|l| l.iter().any(|l| Arc::ptr_eq(l, e.link()))))
            .map(|e| e.id().to_string())
            .collect();
        let mut moved = Vec::new();
        for id in &ids {
            let e = &self.exports[id];
            if e.writable() && to.is_read_only() {
                return Err(DaemonError::Invalid(format!(
                    "Cannot move writable export '{id}' to read-only node '{}'",
                    to.name
                )));
            }
            if let Some(c) = self.export_claims.get(id) {
                moved.push((id.clone(), c.transfer(to)?));
            }
        }
        for id in &ids {
            self.exports[id].link().repoint(to.clone());
        }
        for (id, c) in moved {
            self.export_claims.insert(id, c);
        }
        Ok(())
    }

    /// Deletes every export, disconnecting its clients and unmounting FUSE files.
    pub(super) fn drain_exports(&mut self) {
        let ids: Vec<String> = self.exports.keys().cloned().collect();
        for id in ids {
            if let Some(e) = self.exports.get(&id) {
                e.log_statistics();
            }
            self.begin_export_removal(&id);
        }
    }
}
