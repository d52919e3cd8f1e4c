//! The NBD export as the daemon holds it: `block-export-add` / `--export type=nbd` builds an
//! [`NbdExport`] from its options and adds it to the running server's table; the handle
//! implements the daemon's [`Export`] (its id, node, stop and drain).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use stord_aio::Remote;

use super::export::{ExportTable, NbdExport};
use super::server::NbdServer;
use crate::block::node::block_node::BlockNode;
use crate::block::node::dirty_bitmap::{DirtyBitmap, Use};
use crate::block::node::link::NodeLink;
use crate::cli::keyval::KeyVal;
use crate::export::budget::MemoryBudget;
use crate::export::{Export, ExportEnv, ExportError};

/// An NBD export as the daemon holds it: the export and the server table offering it.
pub struct NbdExportHandle {
    export: Arc<NbdExport>,
    table: ExportTable,
}

/// Most bitmaps one export offers.
const MAX_EXPORT_BITMAPS: usize = 32;

/// The `bitmaps` an export offers: each a name found on the node or down its chain of
/// filters and backing files, or `{node, name}` (QEMU's rules and texts). A read-only
/// export refuses a recording bitmap only when it was named by a string and found on a
/// writable node of its own chain; the `{node, name}` form takes the bitmap as given, as
/// QEMU's nbd_export_create does (a pull backup exports an enabled bitmap that way).
fn export_bitmaps(
    env: &ExportEnv<'_>,
    kv: &mut KeyVal,
    node: &Arc<BlockNode>,
    writable: bool,
) -> Result<Vec<Arc<DirtyBitmap>>, ExportError> {
    let mut out: Vec<Arc<DirtyBitmap>> = Vec::new();
    for i in 0.. {
        let key = format!("bitmaps.{i}");
        let b = if let Some(name) = kv.take(&key) {
            let mut at = Some(node.clone());
            let mut found = None;
            while let Some(n) = at {
                if let Ok(b) = n.bitmap(&name) {
                    found = Some((b, n));
                    break;
                }
                at = n.filtered_or_backing();
            }
            let (b, owner) = found
                .ok_or_else(|| ExportError::Invalid(format!("Bitmap '{name}' is not found")))?;
            if !writable && !owner.is_read_only() && b.is_recording() {
                return Err(ExportError::Invalid(format!(
                    "Enabled bitmap '{name}' incompatible with readonly export"
                )));
            }
            b
        } else if let Some(mut o) = kv.take_prefixed(&key) {
            let node_name = o.take_required("node")?;
            let name = o.take_required("name")?;
            o.finish()?;
            let n = env
                .node(&kv.what, &node_name)
                .map_err(|_| ExportError::Invalid(format!("Node '{node_name}' not found")))?;
            n.bitmap(&name)
                .map_err(|e| ExportError::Invalid(e.to_string()))?
        } else {
            break;
        };
        b.check(Use::AllowReadOnly)
            .map_err(|e| ExportError::Invalid(e.to_string()))?;
        if out.len() == MAX_EXPORT_BITMAPS {
            return Err(ExportError::Invalid(format!(
                "an export offers at most {MAX_EXPORT_BITMAPS} bitmaps"
            )));
        }
        out.push(b);
    }
    Ok(out)
}

/// The smallest per-export buffer limit (one large request must fit).
const FREE_REQUEST_FLOOR: usize = 1 << 20;

/// `--export type=nbd` / `block-export-add`: needs the NBD server running.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let id = kv.take_required("id")?;
    let node_name = kv.take_required("node-name")?;
    let node = env.node(&kv.what, &node_name)?;
    let name = kv.take("name").unwrap_or_else(|| node_name.clone());
    let description = kv.take("description").unwrap_or_default();
    let writable = kv.take_bool("writable", false)?;
    let writethrough = kv.take_bool("writethrough", false)?;
    let _ = kv.take_bool("fixed-iothread", false)?;
    let allocation_depth = kv.take_bool("allocation-depth", false)?;
    let names = kv.take_list("iothread");
    let bitmaps = export_bitmaps(env, &mut kv, &node, writable)?;
    // multi-conn is safe whenever it is asked for or left to us: every connection reaches
    // the same node, and a flush (fdatasync of the one file) covers every write completed
    // before it, whichever connection sent it.
    let multi_conn = !matches!(
        kv.take_choice("multi-conn", &["on", "off", "auto"])?
            .as_deref(),
        Some("off")
    );
    let buffer_limit = kv.take_u64("x-buffer-limit", true)?;
    let what = kv.what.clone();
    let iothreads = env.remotes(&what, &names)?;
    kv.finish()?;
    if writable && node.is_read_only() {
        return Err(
            format!("{what}: node '{node_name}' is read-only, cannot export it writable").into(),
        );
    }
    let Some(server) = env.server::<NbdServer>("nbd") else {
        return Err(ExportError::Invalid("NBD server not running".into()));
    };
    let table = server.table();
    let limit = buffer_limit.map_or(server.budget.limit() / 2, |l| l as usize);
    let mut export = NbdExport::new(id, name, description, node, writable, iothreads, multi_conn);
    export.budget = Arc::new(MemoryBudget::new(limit.max(FREE_REQUEST_FLOOR)));
    export.allocation_depth = allocation_depth;
    export.writethrough = writethrough;
    // Busy from now until the export goes (its Drop), as QEMU marks them.
    for b in &bitmaps {
        b.set_busy(true);
    }
    export.bitmaps = bitmaps;
    let export = Arc::new(export);
    table
        .add(export.clone())
        .map_err(|e| format!("{what}: {e}"))?;
    Ok(Box::new(NbdExportHandle {
        export,
        table: table.clone(),
    }))
}

impl Export for NbdExportHandle {
    fn id(&self) -> &str {
        &self.export.id
    }
    fn kind(&self) -> &'static str {
        "nbd"
    }
    fn writable(&self) -> bool {
        self.export.writable
    }
    fn link(&self) -> &Arc<NodeLink> {
        &self.export.link
    }
    fn runs_on(&self, thread: &Remote) -> bool {
        self.export
            .iothreads
            .iter()
            .any(|r| r.thread_id() == thread.thread_id())
    }
    fn in_use(&self) -> bool {
        self.export.client_count() > 0
    }
    fn shutting_down(&self) -> bool {
        self.export.shutting_down.load(Ordering::SeqCst)
    }
    fn begin_stop(&mut self) {
        self.table.remove_id(&self.export.id);
        self.export.disconnect_all();
    }
    fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.export
            .drain
            .poll(cx, || self.export.client_count() == 0)
    }
}
