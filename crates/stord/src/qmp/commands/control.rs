//! The monitor and the process: version, the command list and schema, `transaction`,
//! `quit`.

use serde_json::{json, Value};

use super::{opt, req, Command, Ty, COMMANDS};
use crate::qmp::QmpError;

pub const QUERY_VERSION: Command = Command {
    name: "query-version",
    args: &[],
    open: false,
    run: |_, _| {
        Ok(json!({
            "qemu": { "major": 0, "minor": 1, "micro": 0 },
            "package": format!("stord {}", env!("CARGO_PKG_VERSION")),
        }))
    },
};

pub const QUERY_COMMANDS: Command = Command {
    name: "query-commands",
    args: &[],
    open: false,
    run: |_, _| {
        let names = std::iter::once("qmp_capabilities").chain(COMMANDS.iter().map(|c| c.name));
        Ok(Value::Array(names.map(|c| json!({ "name": c })).collect()))
    },
};

pub const QUERY_QMP_SCHEMA: Command = Command {
    name: "query-qmp-schema",
    args: &[],
    open: false,
    run: |_, _| Ok(super::schema()),
};

/// QEMU's transaction actions are backups, snapshots and dirty bitmaps, none of which
/// stord has yet; `abort` (which fails the transaction) is the one it honours.
pub const TRANSACTION: Command = Command {
    name: "transaction",
    args: &[req("actions", Ty::Array), opt("properties", Ty::Object)],
    open: false,
    run: |_, mut a| {
        let actions = a.array("actions").unwrap_or_default();
        let mut abort = false;
        for act in &actions {
            match act.get("type").and_then(Value::as_str) {
                Some("abort") => abort = true,
                Some(t) => {
                    return Err(QmpError::generic(format!(
                        "transaction: action '{t}' is not supported by stord (supported: abort)"
                    )))
                }
                None => return Err(super::missing("type")),
            }
        }
        if abort {
            return Err(QmpError::generic("Transaction aborted using Abort action"));
        }
        Ok(json!({}))
    },
};

pub const QUIT: Command = Command {
    name: "quit",
    args: &[],
    open: false,
    run: |state, _| {
        state.borrow().request_quit("host-qmp-quit");
        Ok(json!({}))
    },
};
