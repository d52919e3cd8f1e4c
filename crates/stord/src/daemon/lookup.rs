//! Nodes named in a command's arguments, looked up by QEMU's rules (bdrv_lookup_bs):
//! stord's nodes have no device names, so a `device` may name a node-name too.

use std::sync::Arc;

use super::error::{invalid, DaemonError};
use super::state::State;
use crate::block::node::block_node::BlockNode;

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

    pub(super) fn lookup_node(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.find_node("", name)
    }

    /// A node named as both device and node (QEMU's lookups of a `device` argument).
    pub(super) fn device_node(&self, name: &str) -> Result<Arc<BlockNode>, DaemonError> {
        self.find_node(name, name)
    }
}
