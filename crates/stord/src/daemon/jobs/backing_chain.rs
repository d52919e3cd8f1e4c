//! A node's backing chain as QEMU's stream and commit walk it, each image with its
//! allocation depth, and the name and format an image's header gives its new backing
//! file once the job has changed the chain.

use std::sync::Arc;

use crate::block::node::block_node::BlockNode;

/// The chain below `top` as bdrv_filter_or_cow_bs walks it, `top` first, each node with
/// its depth as allocation_depth counts it (top is 1; a backing link adds one, a
/// filter's file link none).
pub(super) fn chain(top: &Arc<BlockNode>) -> Vec<(Arc<BlockNode>, u32)> {
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

/// The name and format an image's header gives `base` as its backing file: `given`, else
/// the path of the first non-filter node (QEMU's bdrv_skip_filters and `filename`), and
/// its driver (a protocol driver as `raw` with `mask_protocol`).
pub(super) fn backing_name(
    base: &Arc<BlockNode>,
    given: Option<String>,
    mask_protocol: bool,
) -> (String, String) {
    let mut unfiltered = base.clone();
    while unfiltered.driver_name() == "throttle" {
        match unfiltered.filtered_or_backing() {
            Some(n) => unfiltered = n,
            None => break,
        }
    }
    let fmt = match unfiltered.driver_name() {
        "file" | "host_device" if mask_protocol => "raw",
        f => f,
    };
    (
        given.or_else(|| unfiltered.filename()).unwrap_or_default(),
        fmt.to_string(),
    )
}
