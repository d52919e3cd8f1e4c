//! Dirty bitmaps: `block-dirty-bitmap-add/remove/clear/enable/disable/merge` and
//! `x-debug-block-dirty-bitmap-sha256`, with QEMU's names, defaults and texts.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{opt, req, type_error, Args, Command, Ty};
use crate::block::node::block_node::BlockNode;
use crate::block::node::dirty_bitmap::{BitmapError, DirtyBitmap, Use};
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

/// The node of an existing bitmap (QEMU's block_dirty_bitmap_lookup and its text).
fn bitmap_node(state: &SharedState, a: &mut Args) -> Result<Arc<BlockNode>, QmpError> {
    let name = a.str_req("node")?;
    let n = state.borrow().node_by_name(&name).ok();
    n.ok_or_else(|| QmpError::generic(format!("Node '{name}' not found")))
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
    ret: Ty::Any,
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
    ret: Ty::Any,
    run: |state, mut a| {
        let n = bitmap_node(state, &mut a)?;
        let name = a.str_req("name")?;
        // A persistent bitmap leaves the image now: a few writes, waited for here as
        // QEMU's monitor does.
        crate::block::helper_thread::block_on_helper(move || async move {
            n.remove_bitmap(&name).await
        })
        .map_err(|e| QmpError::generic(e.to_string()))??;
        Ok(json!({}))
    },
};

pub const CLEAR: Command = Command {
    name: "block-dirty-bitmap-clear",
    args: NODE_NAME,
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let n = bitmap_node(state, &mut a)?;
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
    ret: Ty::Any,
    run: |state, mut a| {
        let n = bitmap_node(state, &mut a)?;
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
    ret: Ty::Any,
    run: |state, mut a| {
        let n = bitmap_node(state, &mut a)?;
        let b = n.bitmap(&a.str_req("name")?)?;
        b.check(Use::AllowReadOnly)?;
        b.set_recording(false);
        Ok(json!({}))
    },
};

pub const MERGE: Command = Command {
    name: "block-dirty-bitmap-merge",
    args: MERGE_ARGS,
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let (target, sources) = merge_bitmaps(state, &mut a)?;
        merge_into(&target, &sources);
        Ok(json!({}))
    },
};

const MERGE_ARGS: &[super::Arg] = &[
    req("node", Ty::Str),
    req("target", Ty::Str),
    req("bitmaps", Ty::Array),
];

/// A merge's target and sources, each looked up and checked before anything changes.
fn merge_bitmaps(
    state: &SharedState,
    a: &mut Args,
) -> Result<(Arc<DirtyBitmap>, Vec<Arc<DirtyBitmap>>), QmpError> {
    let n = bitmap_node(state, a)?;
    let target = n.bitmap(&a.str_req("target")?)?;
    target.check(Use::Modify)?;
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
    Ok((target, sources))
}

fn merge_into(target: &Arc<DirtyBitmap>, sources: &[Arc<DirtyBitmap>]) {
    for s in sources {
        if !Arc::ptr_eq(s, target) {
            target.merge(s);
        }
    }
}

/// A bitmap action of a `transaction`, done: what undoes it if a later action fails, and
/// what finishes it once all succeeded (QEMU's prepare / abort / commit).
pub struct Prepared {
    pub abort: Box<dyn FnOnce()>,
    pub commit: Box<dyn FnOnce()>,
}

fn prepared(abort: impl FnOnce() + 'static) -> Prepared {
    Prepared {
        abort: Box::new(abort),
        commit: Box::new(|| {}),
    }
}

/// Runs the bitmap action `ty` of a transaction (None: not a bitmap action).
pub fn transaction_action(
    state: &SharedState,
    ty: &str,
    data: serde_json::Map<String, Value>,
) -> Option<Result<Prepared, QmpError>> {
    let spec = match ty {
        "block-dirty-bitmap-add" => ADD.args,
        "block-dirty-bitmap-merge" => MERGE_ARGS,
        "block-dirty-bitmap-remove"
        | "block-dirty-bitmap-clear"
        | "block-dirty-bitmap-enable"
        | "block-dirty-bitmap-disable" => NODE_NAME,
        _ => return None,
    };
    let run = || -> Result<Prepared, QmpError> {
        let mut a = Args::check(data, spec, false)?;
        if ty == "block-dirty-bitmap-merge" {
            let (target, sources) = merge_bitmaps(state, &mut a)?;
            let before = target.backup();
            merge_into(&target, &sources);
            return Ok(prepared(move || target.restore(before)));
        }
        let n = if ty == "block-dirty-bitmap-add" {
            node(state, &mut a)?
        } else {
            bitmap_node(state, &mut a)?
        };
        let name = a.str_req("name")?;
        if ty == "block-dirty-bitmap-add" {
            (ADD.run)(state, a_with(&n.name, &name, a))?;
            let b = n.bitmap(&name)?;
            return Ok(prepared(move || n.forget_bitmap(&b)));
        }
        let b = n.bitmap(&name)?;
        Ok(match ty {
            "block-dirty-bitmap-remove" => {
                // Out of the image now, off the node at commit; busy meanwhile.
                b.check(Use::Remove)?;
                let (n2, b2) = (n.clone(), b.clone());
                crate::block::helper_thread::block_on_helper(move || async move {
                    n2.unstore_bitmap(&b2).await
                })
                .map_err(|e| QmpError::generic(e.to_string()))??;
                b.set_busy(true);
                let b2 = b.clone();
                Prepared {
                    abort: Box::new(move || b2.set_busy(false)),
                    commit: Box::new(move || n.forget_bitmap(&b)),
                }
            }
            "block-dirty-bitmap-clear" => {
                b.check(Use::Modify)?;
                let before = b.backup();
                b.clear();
                prepared(move || b.restore(before))
            }
            _ => {
                b.check(Use::AllowReadOnly)?;
                let was = b.is_recording();
                b.set_recording(ty == "block-dirty-bitmap-enable");
                prepared(move || b.set_recording(was))
            }
        })
    };
    Some(run())
}

/// The arguments of an add again, with the node and name taken out before.
fn a_with(node: &str, name: &str, mut a: Args) -> Args {
    a.insert("node".into(), json!(node));
    a.insert("name".into(), json!(name));
    a
}

pub const SHA256: Command = Command {
    name: "x-debug-block-dirty-bitmap-sha256",
    args: NODE_NAME,
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let n = bitmap_node(state, &mut a)?;
        Ok(json!({ "sha256": n.bitmap(&a.str_req("name")?)?.sha256() }))
    },
};
