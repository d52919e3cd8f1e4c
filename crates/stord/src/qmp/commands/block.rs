//! Block nodes: `blockdev-add/del`, `blockdev-reopen`, `block_resize`,
//! `query-named-block-nodes`.

use serde_json::{json, Value};

use super::{opt, req, type_error, Arg, Args, Command, Ty};
use crate::qmp::QmpError;

pub const BLOCKDEV_ADD: Command = Command {
    name: "blockdev-add",
    args: &[
        req("driver", Ty::Enum(&crate::block::drivers::BLOCKDEV_DRIVER)),
        opt("node-name", Ty::Str),
        opt("filename", Ty::Str),
        opt("aio", Ty::Str),
    ],
    open: true,
    ret: Ty::Any,
    run: |state, a| {
        state
            .borrow_mut()
            .add_blockdev(a.into_keyval("blockdev-add"))?;
        Ok(json!({}))
    },
};

pub const BLOCKDEV_SET_ACTIVE: Command = Command {
    name: "blockdev-set-active",
    args: &[opt("node-name", Ty::Str), req("active", Ty::Bool)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let node = a.str("node-name");
        let active = a.bool("active").unwrap_or(true);
        state
            .borrow_mut()
            .blockdev_set_active(node.as_deref(), active)?;
        Ok(json!({}))
    },
};

pub const BLOCKDEV_SNAPSHOT: Command = Command {
    name: "blockdev-snapshot",
    args: &[req("node", Ty::Str), req("overlay", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let (node, overlay) = (a.str_req("node")?, a.str_req("overlay")?);
        let _held = crate::daemon::snapshot::hold_all_exports(state);
        state.borrow_mut().blockdev_snapshot(&node, &overlay)?;
        Ok(json!({}))
    },
};

pub const BLOCKDEV_SNAPSHOT_SYNC: Command = Command {
    name: "blockdev-snapshot-sync",
    args: &[
        opt("device", Ty::Str),
        opt("node-name", Ty::Str),
        req("snapshot-file", Ty::Str),
        opt("snapshot-node-name", Ty::Str),
        opt("format", Ty::Str),
        opt("mode", Ty::Str),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let o = snapshot_sync_options(&mut a)?;
        let _held = crate::daemon::snapshot::hold_all_exports(state);
        state.borrow_mut().blockdev_snapshot_sync(o)?;
        Ok(json!({}))
    },
};

/// A snapshot action of a `transaction` (None: not one): done now, undone if a later
/// action fails.
pub fn snapshot_action(
    state: &crate::daemon::SharedState,
    ty: &str,
    data: serde_json::Map<String, Value>,
) -> Option<Result<super::bitmap::Prepared, QmpError>> {
    let spec = match ty {
        "blockdev-snapshot" => BLOCKDEV_SNAPSHOT.args,
        "blockdev-snapshot-sync" => BLOCKDEV_SNAPSHOT_SYNC.args,
        "blockdev-snapshot-internal-sync" => return Some(internal_snapshot_action(state, data)),
        _ => return None,
    };
    let run = || -> Result<super::bitmap::Prepared, QmpError> {
        let mut a = Args::check(data, spec, false)?;
        let done = if ty == "blockdev-snapshot" {
            let (node, overlay) = (a.str_req("node")?, a.str_req("overlay")?);
            state.borrow_mut().blockdev_snapshot(&node, &overlay)?
        } else {
            let o = snapshot_sync_options(&mut a)?;
            state.borrow_mut().blockdev_snapshot_sync(o)?
        };
        let st = state.clone();
        Ok(super::bitmap::Prepared {
            abort: Box::new(move || st.borrow_mut().undo_snapshot(done)),
            commit: Box::new(|| {}),
        })
    };
    Some(run())
}

/// The `blockdev-snapshot-internal-sync` transaction action: taken at prepare, deleted
/// again if the transaction aborts (QEMU's internal_snapshot_abort).
fn internal_snapshot_action(
    state: &crate::daemon::SharedState,
    data: serde_json::Map<String, Value>,
) -> Result<super::bitmap::Prepared, QmpError> {
    let mut a = Args::check(data, BLOCKDEV_SNAPSHOT_INTERNAL_SYNC.args, false)?;
    let (device, name) = (a.str_req("device")?, a.str_req("name")?);
    let info = state.borrow_mut().snapshot_internal(&device, &name)?;
    let st = state.clone();
    Ok(super::bitmap::Prepared {
        abort: Box::new(move || {
            let r =
                st.borrow_mut()
                    .snapshot_delete_internal(&device, Some(&info.id), Some(&info.name));
            if let Err(e) = r {
                tracing::error!("transaction abort: snapshot '{name}' stays: {e}");
            }
        }),
        commit: Box::new(|| {}),
    })
}

/// blockdev-snapshot-sync's arguments (also a transaction action's).
pub fn snapshot_sync_options(
    a: &mut Args,
) -> Result<crate::daemon::snapshot::SnapshotSyncOptions, QmpError> {
    let existing = match a.str("mode").as_deref() {
        None | Some("absolute-paths") => false,
        Some("existing") => true,
        Some(m) => {
            return Err(QmpError::generic(format!(
                "Parameter 'mode' does not accept value '{m}'"
            )))
        }
    };
    Ok(crate::daemon::snapshot::SnapshotSyncOptions {
        device: a.str("device"),
        node_name: a.str("node-name"),
        snapshot_file: a.str_req("snapshot-file")?,
        snapshot_node_name: a.str("snapshot-node-name"),
        format: a.str("format"),
        existing,
    })
}

pub const BLOCKDEV_DEL: Command = Command {
    name: "blockdev-del",
    args: &[req("node-name", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        state.borrow_mut().del_blockdev(&a.str_req("node-name")?)?;
        Ok(json!({}))
    },
};

pub const BLOCK_RESIZE: Command = Command {
    name: "block_resize",
    args: &[
        opt("device", Ty::Str),
        opt("node-name", Ty::Str),
        req("size", Ty::Int),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let device = a.str("device");
        let node_name = a.str("node-name");
        let size = a.i64("size").unwrap_or(-1);
        state
            .borrow_mut()
            .resize_node(device.as_deref(), node_name.as_deref(), size)?;
        Ok(json!({}))
    },
};

pub const CHANGE_BACKING_FILE: Command = Command {
    name: "change-backing-file",
    args: &[
        req("device", Ty::Str),
        req("image-node-name", Ty::Str),
        req("backing-file", Ty::Str),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let (device, image) = (a.str_req("device")?, a.str_req("image-node-name")?);
        let backing = a.str_req("backing-file")?;
        state
            .borrow_mut()
            .change_backing_file(&device, &image, &backing)?;
        Ok(json!({}))
    },
};

/// QEMU's SnapshotInfo.
fn snapshot_info(s: &crate::block::node::block_node::SnapshotInfo) -> Value {
    let mut v = json!({
        "id": s.id,
        "name": s.name,
        "vm-state-size": s.vm_state_size,
        "date-sec": s.date_sec,
        "date-nsec": s.date_nsec,
        "vm-clock-sec": s.vm_clock_nsec / 1_000_000_000,
        "vm-clock-nsec": s.vm_clock_nsec % 1_000_000_000,
    });
    if let Some(i) = s.icount {
        v["icount"] = i.into();
    }
    v
}

pub const BLOCKDEV_SNAPSHOT_INTERNAL_SYNC: Command = Command {
    name: "blockdev-snapshot-internal-sync",
    args: &[req("device", Ty::Str), req("name", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let (device, name) = (a.str_req("device")?, a.str_req("name")?);
        let _held = crate::daemon::snapshot::hold_all_exports(state);
        state.borrow_mut().snapshot_internal(&device, &name)?;
        Ok(json!({}))
    },
};

pub const BLOCKDEV_SNAPSHOT_DELETE_INTERNAL_SYNC: Command = Command {
    name: "blockdev-snapshot-delete-internal-sync",
    args: &[
        req("device", Ty::Str),
        opt("id", Ty::Str),
        opt("name", Ty::Str),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let device = a.str_req("device")?;
        let (id, name) = (a.str("id"), a.str("name"));
        let _held = crate::daemon::snapshot::hold_all_exports(state);
        let info =
            state
                .borrow_mut()
                .snapshot_delete_internal(&device, id.as_deref(), name.as_deref())?;
        Ok(snapshot_info(&info))
    },
};

pub const X_BLOCKDEV_SET_IOTHREAD: Command = Command {
    name: "x-blockdev-set-iothread",
    args: &[
        req("node-name", Ty::Str),
        req("iothread", Ty::Any),
        opt("force", Ty::Bool),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let name = a.str_req("node-name")?;
        let iothread = match a.take("iothread") {
            Some(Value::String(s)) => Some(s),
            Some(Value::Null) => None,
            _ => return Err(super::type_error("iothread", "string or null")),
        };
        let force = a.bool("force").unwrap_or(false);
        state
            .borrow_mut()
            .set_node_iothread(&name, iothread.as_deref(), force)?;
        Ok(json!({}))
    },
};

pub const X_BLOCKDEV_CHANGE: Command = Command {
    name: "x-blockdev-change",
    args: &[
        req("parent", Ty::Str),
        opt("child", Ty::Str),
        opt("node", Ty::Str),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let parent = a.str_req("parent")?;
        let (child, node) = (a.str("child"), a.str("node"));
        state
            .borrow_mut()
            .blockdev_change(&parent, child.as_deref(), node.as_deref())?;
        Ok(json!({}))
    },
};

pub const BLOCK_SET_WRITE_THRESHOLD: Command = Command {
    name: "block-set-write-threshold",
    args: &[req("node-name", Ty::Str), req("write-threshold", Ty::Uint)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let name = a.str_req("node-name")?;
        let st = state.borrow();
        let node = st
            .node(&name)
            .ok_or_else(|| QmpError::generic(format!("Device '{name}' not found")))?;
        node.set_write_threshold(a.i64("write-threshold").unwrap_or(0) as u64);
        Ok(json!({}))
    },
};

/// QEMU lists the BlockBackends of guest devices and `-drive`s here; a storage daemon has
/// none (qsd answers an empty list too), its nodes are in query-named-block-nodes.
pub const QUERY_BLOCK: Command = Command {
    name: "query-block",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |_, _| Ok(json!([])),
};

/// Without `query-nodes`, QEMU's per-device list (empty, as query-block); with it, every
/// node's counters ([`crate::block::node::stats`]), each with its `file` child's as `parent`.
pub const QUERY_BLOCKSTATS: Command = Command {
    name: "query-blockstats",
    args: &[opt("query-nodes", Ty::Bool)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        if !a.bool("query-nodes").unwrap_or(false) {
            return Ok(json!([]));
        }
        let st = state.borrow();
        Ok(Value::Array(st.nodes().map(|n| node_stats(n)).collect()))
    },
};

/// One node's entry in query-blockstats.
fn node_stats(n: &crate::block::node::block_node::BlockNode) -> Value {
    let mut v = json!({ "node-name": n.name, "stats": n.stats.to_qmp() });
    if let Some((_, file)) = n.children().into_iter().find(|(role, _)| *role == "file") {
        v["parent"] = node_stats(&file);
    }
    v
}

/// The graph as QEMU's debugging command draws it: every node (block-driver), every
/// export (block-backend) and job (block-job) that uses one, and an edge per use with
/// the permissions taken and shared ([`crate::block::node::perm`]).
pub const X_DEBUG_QUERY_BLOCK_GRAPH: Command = Command {
    name: "x-debug-query-block-graph",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        let st = state.borrow();
        let mut nodes: Vec<Value> = Vec::new();
        let mut ids = std::collections::BTreeMap::new();
        let add = |nodes: &mut Vec<Value>, name: &str, ty: &str| {
            let id = nodes.len() + 1;
            nodes.push(json!({ "id": id, "type": ty, "name": name }));
            id
        };
        for n in st.nodes() {
            ids.insert(n.name.clone(), add(&mut nodes, &n.name, "block-driver"));
        }
        let mut jobs = std::collections::BTreeMap::new();
        let mut edges = Vec::new();
        for n in st.nodes() {
            for (user, role, perm, shared) in n.users_now() {
                let parent = match ids.get(&user) {
                    Some(&id) => id,
                    // An export: an anonymous BlockBackend, as QEMU's.
                    None if role == "root" => add(&mut nodes, "", "block-backend"),
                    // A job: named by its id, as QEMU names a job's graph node.
                    None => {
                        let job = user.split('\'').nth(1).unwrap_or(&user).to_string();
                        *jobs
                            .entry(job.clone())
                            .or_insert_with(|| add(&mut nodes, &job, "block-job"))
                    }
                };
                edges.push(json!({
                    "parent": parent,
                    "child": ids[&n.name],
                    "name": role,
                    "perm": perm.qapi_names(),
                    "shared-perm": shared.qapi_names(),
                }));
            }
        }
        Ok(json!({ "nodes": nodes, "edges": edges }))
    },
};

/// QEMU's BlockLimitsInfo (10.2), as `image.limits` reports it.
const BLOCK_LIMITS_INFO: &[Arg] = &[
    req("request-alignment", Ty::Uint),
    opt("max-discard", Ty::Uint),
    opt("discard-alignment", Ty::Uint),
    opt("max-write-zeroes", Ty::Uint),
    opt("write-zeroes-alignment", Ty::Uint),
    opt("opt-transfer", Ty::Uint),
    opt("max-transfer", Ty::Uint),
    opt("max-hw-transfer", Ty::Uint),
    req("max-iov", Ty::Int),
    opt("max-hw-iov", Ty::Int),
    req("min-mem-alignment", Ty::Uint),
    req("opt-mem-alignment", Ty::Uint),
];

/// The members of QEMU's ImageInfo that stord reports.
const IMAGE_INFO: &[Arg] = &[
    req("filename", Ty::Str),
    req("format", Ty::Str),
    req("virtual-size", Ty::Int),
    opt("actual-size", Ty::Int),
    opt("dirty-flag", Ty::Bool),
    opt("encrypted", Ty::Bool),
    opt("limits", Ty::Struct(BLOCK_LIMITS_INFO)),
];

/// QEMU's BlockdevChild (10.1).
const BLOCKDEV_CHILD: &[Arg] = &[req("child", Ty::Str), req("node-name", Ty::Str)];

/// The members of QEMU's BlockDeviceInfo that stord reports.
const BLOCK_DEVICE_INFO: &[Arg] = &[
    req("file", Ty::Str),
    opt("node-name", Ty::Str),
    req("ro", Ty::Bool),
    req("drv", Ty::Str),
    req("backing_file_depth", Ty::Int),
    req("encrypted", Ty::Bool),
    req("active", Ty::Bool),
    req("detect_zeroes", Ty::Str),
    req("bps", Ty::Int),
    req("bps_rd", Ty::Int),
    req("bps_wr", Ty::Int),
    req("iops", Ty::Int),
    req("iops_rd", Ty::Int),
    req("iops_wr", Ty::Int),
    req("image", Ty::Struct(IMAGE_INFO)),
    req("write_threshold", Ty::Int),
    opt("dirty-bitmaps", Ty::Array),
    req("cache", Ty::Object),
    req("children", Ty::List(&Ty::Struct(BLOCKDEV_CHILD))),
];

pub const QUERY_NAMED_BLOCK_NODES: Command = Command {
    name: "query-named-block-nodes",
    args: &[opt("flat", Ty::Bool)],
    open: false,
    ret: Ty::List(&Ty::Struct(BLOCK_DEVICE_INFO)),
    run: |state, _| {
        let st = state.borrow();
        Ok(Value::Array(st.nodes().map(|n| node_info(n)).collect()))
    },
};

/// One node as QEMU's `BlockDeviceInfo`.
fn node_info(n: &crate::block::node::block_node::BlockNode) -> Value {
    let mut v = node_fields(n);
    let bitmaps = n.bitmaps();
    if !bitmaps.is_empty() {
        v["dirty-bitmaps"] = Value::Array(bitmaps.iter().map(|b| b.info()).collect());
    }
    v
}

fn node_fields(n: &crate::block::node::block_node::BlockNode) -> Value {
    let file = n
        .filename()
        .unwrap_or_else(|| format!("{}://", n.driver_name()));
    let actual = n
        .filename()
        .and_then(|f| std::fs::metadata(f).ok())
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .unwrap_or(0);
    let mut v = json!({
        "node-name": n.name,
        "drv": n.driver_name(),
        "ro": n.is_read_only(),
        "file": file,
        "encrypted": n.driver().encrypted(),
        "active": !n.is_inactive(),
        "backing_file_depth": n.backing_depth(),
        // QEMU 10.1's BlockdevChild list, in the node's child order (QEMU's bs->children:
        // as they were attached, the file before the backing image).
        "children": n.children().iter()
            .map(|(role, c)| json!({ "child": role, "node-name": c.name }))
            .collect::<Vec<_>>(),
        "detect_zeroes": n.detect_zeroes().name(),
        "write_threshold": n.write_threshold(),
        "bps": 0, "bps_rd": 0, "bps_wr": 0,
        "iops": 0, "iops_rd": 0, "iops_wr": 0,
        "cache": { "writeback": true, "direct": n.direct, "no-flush": n.driver().no_flush() },
        "image": {
            "filename": file,
            "format": n.driver_name(),
            "virtual-size": n.size(),
            "actual-size": actual,
            "dirty-flag": false,
        },
    });
    if let Some(image) = v["image"].as_object_mut() {
        // QEMU 10.2's BlockLimitsInfo: the limits I/O on the node follows.
        image.insert("limits".into(), n.limits().to_qmp());
        if !n.reports_host_size() {
            image.remove("actual-size");
        }
        if !n.has_image_info() {
            image.remove("dirty-flag");
        }
        // QEMU's ImageInfo names only an encrypted image's encryption.
        if n.driver().encrypted() {
            image.insert("encrypted".into(), true.into());
        }
    }
    v
}

/// Options `blockdev-reopen` takes besides `node-name` and `read-only`: they describe the
/// node as it is (libvirt repeats them); stord changes none of them.
const REOPEN_KEPT: &[&str] = &[
    "driver",
    "filename",
    "file",
    "backing",
    "auto-read-only",
    "discard",
    "detect-zeroes",
    "cache",
    "aio",
    "locking",
    "throttle-group",
];

pub const BLOCKDEV_REOPEN: Command = Command {
    name: "blockdev-reopen",
    args: &[req("options", Ty::Array)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        // Checked whole before anything changes.
        let mut todo = Vec::new();
        for o in a.array("options").unwrap_or_default() {
            let Value::Object(o) = o else {
                return Err(type_error("options", "object"));
            };
            let mut o = Args::check(
                o,
                &[req("node-name", Ty::Str), opt("read-only", Ty::Bool)],
                true,
            )?;
            let name = o.str_req("node-name")?;
            // As QEMU: options left out take their defaults, so no read-only is rw.
            let ro = o.bool("read-only").unwrap_or(false);
            let st = state.borrow();
            let Some(node) = st.node(&name) else {
                return Err(QmpError::generic(format!(
                    "Cannot find node named '{name}'"
                )));
            };
            if let Some(Value::String(d)) = o.rest().get("driver") {
                if d != node.driver_name() {
                    return Err(QmpError::generic(format!(
                        "Cannot change the option 'driver' of node '{name}'"
                    )));
                }
            }
            if let Some(k) = o.rest().keys().find(|k| !REOPEN_KEPT.contains(&k.as_str())) {
                return Err(QmpError::generic(format!(
                    "blockdev-reopen: stord can change only 'read-only' (got '{k}')"
                )));
            }
            todo.push((name, ro));
        }
        let mut st = state.borrow_mut();
        for (name, ro) in todo {
            st.reopen_read_only(&name, ro)?;
        }
        Ok(json!({}))
    },
};
