//! The monitor and the process: version, `transaction`, `quit` (the command list and
//! schema are the table's own, in `mod.rs`).

use serde_json::{json, Value};

use super::{opt, req, Command, Ty};
use crate::qmp::QmpError;

pub const QUERY_VERSION: Command = Command {
    name: "query-version",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |_, _| Ok(crate::version::version_info()),
};

/// `transaction`: every action or none. Of QEMU's actions stord has the snapshot and dirty
/// bitmap ones and `abort`; each action is done in turn, and when one fails those before it are undone
/// in reverse order (QEMU's prepare / abort / commit).
pub const TRANSACTION: Command = Command {
    name: "transaction",
    args: &[req("actions", Ty::Array), opt("properties", Ty::Object)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let actions = a.array("actions").unwrap_or_default();
        // Snapshots change what exports serve, and a backup's point in time is shared
        // with the other actions: no request may be inside the graph from the first
        // action to the commit or abort (QEMU drains everything).
        let snapshots = actions.iter().any(|act| {
            matches!(
                act.get("type").and_then(Value::as_str),
                Some(
                    "blockdev-snapshot"
                        | "blockdev-snapshot-sync"
                        | "blockdev-snapshot-internal-sync"
                        | "blockdev-backup"
                        | "drive-backup"
                )
            )
        });
        let _held = if snapshots {
            crate::daemon::snapshot::hold_all_exports(state)
        } else {
            Vec::new()
        };
        let mut done: Vec<super::bitmap::Prepared> = Vec::new();
        let mut fail = None;
        for act in actions {
            let ty = match act.get("type").and_then(Value::as_str) {
                Some(t) => t.to_string(),
                None => {
                    fail = Some(super::missing("type"));
                    break;
                }
            };
            let data = match act.get("data") {
                Some(Value::Object(o)) => o.clone(),
                _ => Default::default(),
            };
            let r = if ty == "abort" {
                Err(QmpError::generic("Transaction aborted using Abort action"))
            } else {
                super::block::snapshot_action(state, &ty, data.clone())
                    .or_else(|| super::job::backup_action(state, &ty, data.clone()))
                    .or_else(|| super::bitmap::transaction_action(state, &ty, data))
                    .unwrap_or_else(|| {
                        Err(QmpError::generic(format!(
                            "transaction: action '{ty}' is not supported by stord \
                             (supported: abort, blockdev-backup, drive-backup, \
                             blockdev-snapshot, blockdev-snapshot-sync, \
                             blockdev-snapshot-internal-sync and the block-dirty-bitmap \
                             actions)"
                        )))
                    })
            };
            match r {
                Ok(p) => done.push(p),
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = fail {
            for p in done.into_iter().rev() {
                (p.abort)();
            }
            return Err(e);
        }
        for p in done {
            (p.commit)();
        }
        Ok(json!({}))
    },
};

pub const QUIT: Command = Command {
    name: "quit",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        state.borrow().request_quit();
        Ok(json!({}))
    },
};
