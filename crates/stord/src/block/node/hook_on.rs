//! A hook installed on a node for as long as its holder lives.

use std::sync::Arc;

use super::block_node::BlockNode;
use super::hook::NodeHook;

/// A hook installed on a node, removed when this is dropped.
pub struct HookOn {
    node: Arc<BlockNode>,
    hook: Arc<dyn NodeHook>,
}

impl HookOn {
    /// Installs `hook` on `node`: requests that start from now on run it. Requests already
    /// past the hook's place do not; callers that need a clean start hold the node's
    /// users first.
    pub fn install(node: &Arc<BlockNode>, hook: Arc<dyn NodeHook>) -> Self {
        node.hooks.add(hook.clone());
        HookOn {
            node: node.clone(),
            hook,
        }
    }
}

impl Drop for HookOn {
    fn drop(&mut self) {
        self.node.hooks.remove(&self.hook);
    }
}
