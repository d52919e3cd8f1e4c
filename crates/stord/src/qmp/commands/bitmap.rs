//! Dirty bitmaps: `block-dirty-bitmap-add/remove/clear/enable/disable/merge` and
//! `x-debug-block-dirty-bitmap-sha256`, with QEMU's names, defaults and texts.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{opt, req, type_error, Args, Command, Ty};
use crate::block::dirty_bitmap::{BitmapError, Use};
use crate::block::BlockNode;
use crate::daemon::SharedState;
use crate::qmp::QmpError;

impl From<BitmapError> for QmpError {
    fn from(e: BitmapError) -> Self {
        QmpError::generic(e.to_string())
    }
}

/// The node a bitmap command names.
fn node(state: &SharedState, a: &mut Args) -> Result<Arc<BlockNode>, QmpError> {
    let name = a.str_req("node")?;
    Ok(state.borrow().node_by_name(&name)?)
}

const NODE_NAME: &[super::Arg] = &[req("node", Ty::Str), req("name", Ty::Str)];

pub const ADD: Command = Command {
    name: "block-dirty-bitmap-add",
    args: &[
        req("node", Ty::Str),
        req("name", Ty::Str),
        opt("granularity", Ty::Uint),
        opt("persistent", Ty::Bool),
        opt("disabled", Ty::Bool),
    ],
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let name = a.str_req("name")?;
        n.new_bitmap(
            &name,
            a.i64("granularity").map(|g| g as u64),
            a.bool("persistent") == Some(true),
            a.bool("disabled") == Some(true),
        )?;
        Ok(json!({}))
    },
};

pub const REMOVE: Command = Command {
    name: "block-dirty-bitmap-remove",
    args: NODE_NAME,
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let name = a.str_req("name")?;
        // A persistent bitmap leaves the image now: a few writes, waited for here as
        // QEMU's monitor does.
        crate::block::block_on_helper(move || async move { n.remove_bitmap(&name).await })
            .map_err(|e| QmpError::generic(e.to_string()))??;
        Ok(json!({}))
    },
};

pub const CLEAR: Command = Command {
    name: "block-dirty-bitmap-clear",
    args: NODE_NAME,
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let b = n.bitmap(&a.str_req("name")?)?;
        b.check(Use::Modify)?;
        b.clear();
        Ok(json!({}))
    },
};

pub const ENABLE: Command = Command {
    name: "block-dirty-bitmap-enable",
    args: NODE_NAME,
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let b = n.bitmap(&a.str_req("name")?)?;
        b.check(Use::AllowReadOnly)?;
        b.set_recording(true);
        Ok(json!({}))
    },
};

pub const DISABLE: Command = Command {
    name: "block-dirty-bitmap-disable",
    args: NODE_NAME,
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let b = n.bitmap(&a.str_req("name")?)?;
        b.check(Use::AllowReadOnly)?;
        b.set_recording(false);
        Ok(json!({}))
    },
};

pub const MERGE: Command = Command {
    name: "block-dirty-bitmap-merge",
    args: &[
        req("node", Ty::Str),
        req("target", Ty::Str),
        req("bitmaps", Ty::Array),
    ],
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        let target = n.bitmap(&a.str_req("target")?)?;
        target.check(Use::Modify)?;
        // Every source is looked up before the target changes.
        let mut sources = Vec::new();
        for s in a.array("bitmaps").unwrap_or_default() {
            let b = match s {
                Value::String(name) => n.bitmap(&name)?,
                Value::Object(o) => {
                    let mut o = Args::check(o, NODE_NAME, false)?;
                    let other = node(state, &mut o)?;
                    other.bitmap(&o.str_req("name")?)?
                }
                _ => return Err(type_error("bitmaps", "string or object")),
            };
            b.check(Use::Read)?;
            sources.push(b);
        }
        for s in sources {
            if !Arc::ptr_eq(&s, &target) {
                target.merge(&s);
            }
        }
        Ok(json!({}))
    },
};

pub const SHA256: Command = Command {
    name: "x-debug-block-dirty-bitmap-sha256",
    args: NODE_NAME,
    open: false,
    run: |state, mut a| {
        let n = node(state, &mut a)?;
        Ok(json!({ "sha256": n.bitmap(&a.str_req("name")?)?.sha256() }))
    },
};
