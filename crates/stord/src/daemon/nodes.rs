//! Operations on the daemon's block nodes beyond opening them ([`super::graph`]):
//! `blockdev-del`, resizing, and `read-only` changes (blockdev-reopen, and what jobs make
//! writable for their life).

use std::sync::Arc;

use crate::block::node::block_node::BlockNode;

use super::close;
use super::error::DaemonError;
use super::state::State;

impl State {
    /// `blockdev-del`: fails while a parent node or an export uses the node. Its inline
    /// children go with it.
    pub fn del_blockdev(&mut self, name: &str) -> Result<(), DaemonError> {
        let Some(node) = self.nodes.get(name) else {
            return Err(DaemonError::NodeNotFound(name.into()));
        };
        if self.implicit.contains(name) {
            // qsd's words: the node was opened inline by its parent, not by blockdev-add.
            return Err(DaemonError::NodeNotOwned(name.into()));
        }
        // A job's own user of the node (a mirror's target) comes first, as QEMU checks
        // for a BlockBackend before the op blockers.
        if node.has_job() {
            return Err(DaemonError::NodeInUse(name.into()));
        }
        node.check_not_busy()?;
        let parents = self.parents_of(name);
        // QEMU blocks every operation on a backing node for its overlay's sake.
        if let Some((parent, _)) = parents.iter().find(|(_, role)| *role == "backing") {
            return Err(DaemonError::Invalid(format!(
                "Node '{name}' is busy: node is used as backing hd of '{parent}'"
            )));
        }
        if let Some((parent, role)) = parents.into_iter().next() {
            return Err(DaemonError::NodeIsChild {
                name: name.into(),
                parent,
                role,
            });
        }
        if self.users(node) > 0 {
            return Err(DaemonError::NodeInUse(name.into()));
        }
        let node = self.nodes.remove(name).expect("present");
        // What a format node still caches (qcow2's tables, its persistent bitmaps) goes
        // to disk before it closes, as QEMU's bdrv_close does.
        close::close_now(&node);
        let children: Vec<String> = node
            .children()
            .iter()
            .map(|(_, c)| c.name.clone())
            .collect();
        drop(node);
        self.drop_implicit(children);
        Ok(())
    }

    /// `block_resize`: with the resize permission for the time it takes (refused while a
    /// user does not share it, as an NBD export whose clients were told the size).
    pub fn resize_node(
        &mut self,
        device: Option<&str>,
        node_name: Option<&str>,
        size: i64,
    ) -> Result<(), DaemonError> {
        let name = node_name.or(device).unwrap_or_default();
        let Some(node) = self.nodes.get(name).cloned() else {
            return Err(DaemonError::Invalid(format!(
                "Cannot find device='{}' nor node-name='{}'",
                device.unwrap_or_default(),
                node_name.unwrap_or_default()
            )));
        };
        let Ok(size) = u64::try_from(size) else {
            return Err(DaemonError::Invalid(
                "Parameter 'size' expects a >0 size".into(),
            ));
        };
        if node.is_read_only() {
            return Err(DaemonError::Invalid("Image is read-only".into()));
        }
        let claim = node.claim(
            "block_resize",
            "root",
            crate::block::node::perm::Perm::RESIZE,
            crate::block::node::perm::Perm::ALL,
        )?;
        let n = node.clone();
        let r =
            crate::block::helper_thread::block_on_helper(
                move || async move { n.resize(size).await },
            );
        drop(claim);
        match r {
            Ok(Ok(())) => {
                for e in self.exports.values() {
                    e.resized();
                }
                Ok(())
            }
            Ok(Err(e)) | Err(e) => Err(DaemonError::Invalid(e.to_string())),
        }
    }

    /// `blockdev-reopen` of one node's `read-only` state. A node goes read-only only when
    /// no writable export or writable parent uses it (after a flush), and writable again
    /// only if it was opened writable: stord does not reopen files with other flags.
    pub fn reopen_read_only(&mut self, name: &str, read_only: bool) -> Result<(), DaemonError> {
        let Some(node) = self.nodes.get(name).cloned() else {
            return Err(DaemonError::NodeNotFound(name.into()));
        };
        if node.is_read_only() == read_only {
            return Ok(());
        }
        if !read_only {
            self.make_writable(&node)?;
            return Ok(());
        }
        // Every node at or above this one, for the writers among their users.
        let mut above = vec![name.to_string()];
        let mut i = 0;
        while i < above.len() {
            for (parent, _) in self.parents_of(&above[i].clone()) {
                if !above.contains(&parent) {
                    above.push(parent);
                }
            }
            i += 1;
        }
        if let Some(e) = self
            .exports
            .values()
            .find(|e| e.writable() && above.contains(&e.node().name))
        {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{name}' read-only: writable export '{}' uses it",
                e.id()
            )));
        }
        if let Some(p) = above[1..]
            .iter()
            .find(|p| self.nodes.get(*p).is_some_and(|n| !n.is_read_only()))
        {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{name}' read-only: writable node '{p}' uses it"
            )));
        }
        let n = node.clone();
        match crate::block::helper_thread::block_on_helper(move || async move { n.flush().await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) | Err(e) => {
                return Err(DaemonError::Invalid(format!(
                    "Cannot make node '{name}' read-only: flush failed: {e}"
                )))
            }
        }
        node.set_read_only(true);
        // What it takes of its children shrinks with it (a format node's write lock goes).
        let _ = node.refresh_perms();
        Ok(())
    }

    /// Makes `node` writable with the nodes it stores its data on (its `file`, a qcow2's
    /// `data-file`, and theirs), as QEMU's reopen with read-only off: bottom-up, each node writable and its
    /// permissions taken on its children (their locks) before its driver reopens (a file
    /// its descriptor read-write, an image its metadata for writing), then its own locks
    /// taken again. On a failure every node changed goes back. The nodes it changed,
    /// top first (to be made read-only again).
    pub fn make_writable(&self, node: &Arc<BlockNode>) -> Result<Vec<Arc<BlockNode>>, DaemonError> {
        // The node and what stores it (files, a qcow2's data file), down to the bottom.
        let mut chain = vec![node.clone()];
        let mut i = 0;
        while i < chain.len() {
            let below = chain[i].children().into_iter();
            chain.extend(
                below
                    .filter(|(r, _)| matches!(*r, "file" | "data-file"))
                    .map(|(_, c)| c),
            );
            i += 1;
        }
        if let Some(n) = chain.iter().find(|n| n.is_inactive()) {
            return Err(DaemonError::Invalid(format!(
                "Cannot make node '{}' writable: it is inactive",
                n.name
            )));
        }
        let mut changed: Vec<Arc<BlockNode>> = Vec::new();
        for n in chain.iter().rev().filter(|n| n.is_read_only()) {
            changed.insert(0, n.clone());
            let r = n
                .refresh_perms_as(false)
                .map_err(DaemonError::from)
                .and_then(|()| {
                    let m = n.clone();
                    crate::block::helper_thread::block_on_helper(move || async move {
                        m.reopen_rw().await
                    })
                    .map_err(|e| e.to_string())
                    .and_then(|r| r)
                    .map_err(|e| {
                        DaemonError::Invalid(format!("Cannot make node '{}' writable: {e}", n.name))
                    })?;
                    n.refresh_perms().map_err(DaemonError::from)
                });
            if let Err(e) = r {
                drop(crate::block::node::read_only_again::ReadOnlyAgain::new(
                    changed,
                ));
                return Err(e);
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::open::GraphError;
    use crate::cli::keyval::{KeyVal, OptionError};

    pub(super) fn kv(s: &str) -> KeyVal {
        KeyVal::parse("--blockdev", s, None).unwrap()
    }

    #[test]
    pub(super) fn graph_errors_are_typed() {
        let mut st = State::default();
        st.add_blockdev(kv("driver=null-co,node-name=n,size=1M"))
            .unwrap();
        st.add_blockdev(kv("driver=raw,node-name=r,file=n"))
            .unwrap();
        assert!(matches!(
            st.add_blockdev(kv("driver=null-co,node-name=n")),
            Err(DaemonError::Graph(GraphError::DuplicateNode(n))) if n == "n"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=nope")),
            Err(DaemonError::Graph(GraphError::ChildNotFound(n))) if n == "nope"
        ));
        assert!(matches!(
            st.add_blockdev(kv("driver=raw,node-name=x,file=n,bogus=1")),
            Err(DaemonError::Graph(GraphError::Option(OptionError::Unknown { key, .. }))) if key == "bogus"
        ));
        assert!(matches!(
            st.del_blockdev("n"),
            Err(DaemonError::NodeIsChild { parent, role: "file", .. }) if parent == "r"
        ));
        assert!(matches!(
            st.del_blockdev("zz"),
            Err(DaemonError::NodeNotFound(_))
        ));
        st.add_blockdev(kv(
            "driver=raw,node-name=i,file.driver=null-co,file.size=1M",
        ))
        .unwrap();
        let child = st.implicit.iter().next().cloned().unwrap();
        assert!(matches!(
            st.del_blockdev(&child),
            Err(DaemonError::NodeNotOwned(_))
        ));
        st.del_blockdev("i").unwrap();
        assert!(st.implicit.is_empty() && !st.nodes.contains_key(&child));
        st.del_blockdev("r").unwrap();
        st.del_blockdev("n").unwrap();
        let e = DaemonError::ExportInUse("e".into());
        assert_eq!(e.qmp_class(), "GenericError");
    }
}
