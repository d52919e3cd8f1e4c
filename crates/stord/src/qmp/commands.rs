//! QMP commands: names, arguments and error texts as qemu-storage-daemon's schema where the
//! two overlap. `query-iothreads` is QEMU's (qsd lacks it) plus our `poll-policy` and
//! `x-stats`.

use serde_json::{json, Map, Value};

use super::QmpError;
use crate::cli::keyval::KeyVal;
use crate::daemon::{SharedState, State};
use crate::export::nbd::{ListenAddr, NbdServerOpts, DEFAULT_HANDSHAKE_MAX_SECS};

/// Every command, for `query-commands`.
pub const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "query-iothreads",
    "qom-get",
    "qom-set",
    "object-add",
    "object-del",
    "blockdev-add",
    "blockdev-del",
    "query-named-block-nodes",
    "nbd-server-start",
    "nbd-server-stop",
    "block-export-add",
    "block-export-del",
    "query-block-exports",
    "blockdev-reopen",
    "block_resize",
    "transaction",
    "quit",
];

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

/// Typed access to a command's arguments, with QEMU's error texts.
struct Args {
    map: Map<String, Value>,
}

impl Args {
    fn type_error(name: &str, expected: &str) -> QmpError {
        QmpError::generic(format!(
            "Invalid parameter type for '{name}', expected: {expected}"
        ))
    }

    fn str_opt(&mut self, name: &str) -> Result<Option<String>, QmpError> {
        match self.map.remove(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(Self::type_error(name, "string")),
        }
    }

    fn str_req(&mut self, name: &str) -> Result<String, QmpError> {
        self.str_opt(name)?
            .ok_or_else(|| QmpError::generic(format!("Parameter '{name}' is missing")))
    }

    fn bool_opt(&mut self, name: &str) -> Result<Option<bool>, QmpError> {
        match self.map.remove(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(_) => Err(Self::type_error(name, "boolean")),
        }
    }

    fn u64_opt(&mut self, name: &str) -> Result<Option<u64>, QmpError> {
        match self.map.remove(name) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(_) => Err(Self::type_error(name, "integer")),
        }
    }

    fn finish(self) -> Result<(), QmpError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(QmpError::generic(format!("Parameter '{k}' is unexpected"))),
        }
    }

    /// The rest as key=value options (nested objects flattened with dots).
    fn into_keyval(self, what: &str) -> KeyVal {
        let mut pairs = Vec::new();
        flatten(&mut pairs, "", &self.map);
        KeyVal::from_pairs(what, pairs)
    }
}

fn flatten(out: &mut Vec<(String, String)>, prefix: &str, map: &Map<String, Value>) {
    for (k, v) in map {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Object(o) => flatten(out, &key, o),
            Value::String(s) => out.push((key, s.clone())),
            Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
            other => out.push((key, other.to_string())),
        }
    }
}

/// Runs one command.
pub async fn execute(
    state: &SharedState,
    cmd: &str,
    args: Map<String, Value>,
) -> Result<Value, QmpError> {
    let mut a = Args { map: args };
    match cmd {
        "query-version" => {
            a.finish()?;
            Ok(json!({
                "qemu": { "major": 0, "minor": 1, "micro": 0 },
                "package": format!("stord {}", env!("CARGO_PKG_VERSION")),
            }))
        }
        "query-commands" => {
            a.finish()?;
            Ok(Value::Array(
                COMMANDS.iter().map(|c| json!({ "name": c })).collect(),
            ))
        }
        "query-iothreads" => {
            a.finish()?;
            Ok(query_iothreads(&state.borrow()))
        }
        "qom-get" => {
            let path = a.str_req("path")?;
            let prop = a.str_req("property")?;
            a.finish()?;
            qom_get(&state.borrow(), &path, &prop)
        }
        "qom-set" => {
            let path = a.str_req("path")?;
            let prop = a.str_req("property")?;
            let value = a
                .map
                .remove("value")
                .ok_or_else(|| QmpError::generic("Parameter 'value' is missing"))?;
            a.finish()?;
            qom_set(&state.borrow(), &path, &prop, value).map(|()| json!({}))
        }
        "object-add" => {
            for k in ["qom-type", "id"] {
                match a.map.get(k) {
                    None => return Err(QmpError::generic(format!("Parameter '{k}' is missing"))),
                    Some(v) if !v.is_string() => return Err(Args::type_error(k, "string")),
                    _ => {}
                }
            }
            for (k, expect_int) in [
                ("poll-max-ns", true),
                ("poll-grow", true),
                ("poll-shrink", true),
                ("poll-weight", true),
                ("poll-grow-start", true),
                ("poll-yield-ns", true),
                ("aio-max-batch", true),
                ("poll-policy", false),
                ("reactor", false),
            ] {
                match a.map.get(k) {
                    Some(v) if expect_int && !v.is_u64() => {
                        return Err(Args::type_error(k, "integer"))
                    }
                    Some(v) if !expect_int && !v.is_string() => {
                        return Err(Args::type_error(k, "string"))
                    }
                    _ => {}
                }
            }
            let kv = a.into_keyval("object-add");
            state
                .borrow_mut()
                .add_object(kv)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "object-del" => {
            let id = a.str_req("id")?;
            a.finish()?;
            state
                .borrow_mut()
                .del_object(&id)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "blockdev-add" => {
            for k in ["driver", "node-name", "filename", "aio"] {
                if let Some(v) = a.map.get(k) {
                    if !v.is_string() {
                        return Err(Args::type_error(k, "string"));
                    }
                }
            }
            let kv = a.into_keyval("blockdev-add");
            state
                .borrow_mut()
                .add_blockdev(kv)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "blockdev-del" => {
            let name = a.str_req("node-name")?;
            a.finish()?;
            state
                .borrow_mut()
                .del_blockdev(&name)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "block_resize" => {
            let device = a.str_opt("device")?;
            let node_name = a.str_opt("node-name")?;
            let size = match a.map.remove("size") {
                Some(v) => v
                    .as_i64()
                    .ok_or_else(|| Args::type_error("size", "integer"))?,
                None => return Err(QmpError::generic("Parameter 'size' is missing")),
            };
            a.finish()?;
            state
                .borrow_mut()
                .resize_node(device.as_deref(), node_name.as_deref(), size)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "query-named-block-nodes" => {
            let _ = a.bool_opt("flat")?;
            a.finish()?;
            Ok(query_named_block_nodes(&state.borrow()))
        }
        "nbd-server-start" => {
            let addr = match a.map.remove("addr") {
                Some(Value::Object(m)) => socket_address_legacy(m)?,
                Some(_) => return Err(Args::type_error("addr", "object")),
                None => return Err(QmpError::generic("Parameter 'addr' is missing")),
            };
            let max_connections = a.u64_opt("max-connections")?.unwrap_or(0) as u32;
            let handshake_max_secs = a
                .u64_opt("handshake-max-seconds")?
                .map_or(DEFAULT_HANDSHAKE_MAX_SECS, |s| {
                    s.min(u64::from(u32::MAX)) as u32
                });
            let tls_creds = a.str_opt("tls-creds")?;
            let tls_authz = a.str_opt("tls-authz")?;
            a.finish()?;
            stord_aio::with_current_context(|ctx| {
                state.borrow_mut().start_nbd_server(
                    ctx,
                    NbdServerOpts {
                        addr,
                        max_connections,
                        handshake_max_secs,
                        tls_creds,
                        tls_authz,
                    },
                )
            })
            .expect("main loop")
            .map(|()| json!({}))
            .map_err(Into::into)
        }
        "nbd-server-stop" => {
            a.finish()?;
            state
                .borrow_mut()
                .stop_nbd_server()
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "block-export-add" => {
            if let Some(Value::Array(list)) = a.map.remove("iothread") {
                // A list of iothreads (FUSE multi-queue): iothread.0, iothread.1, ...
                for (i, t) in list.into_iter().enumerate() {
                    a.map.insert(format!("iothread.{i}"), t);
                }
            }
            for k in [
                "type",
                "id",
                "node-name",
                "name",
                "description",
                "iothread",
                "mountpoint",
            ] {
                if let Some(v) = a.map.get(k) {
                    if !v.is_string() {
                        return Err(Args::type_error(k, "string"));
                    }
                }
            }
            for k in [
                "writable",
                "writethrough",
                "fixed-iothread",
                "allocation-depth",
            ] {
                if let Some(v) = a.map.get(k) {
                    if !v.is_boolean() {
                        return Err(Args::type_error(k, "boolean"));
                    }
                }
            }
            let kv = a.into_keyval("block-export-add");
            state
                .borrow_mut()
                .add_export(kv)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "block-export-del" => {
            let id = a.str_req("id")?;
            let hard = match a.str_opt("mode")?.as_deref() {
                None | Some("safe") => false,
                Some("hard") => true,
                Some(m) => {
                    return Err(QmpError::generic(format!(
                        "Parameter 'mode' does not accept value '{m}'"
                    )))
                }
            };
            a.finish()?;
            state
                .borrow_mut()
                .del_export(&id, hard)
                .map(|()| json!({}))
                .map_err(Into::into)
        }
        "query-block-exports" => {
            a.finish()?;
            let st = state.borrow();
            let v: Vec<Value> = st
                .exports
                .values()
                .map(|e| {
                    let mut m = serde_json::Map::new();
                    m.insert("type".into(), e.kind().into());
                    m.insert("id".into(), e.id().into());
                    m.insert("node-name".into(), e.node().name.clone().into());
                    m.insert("shutting-down".into(), e.shutting_down().into());
                    e.describe(&mut m);
                    Value::Object(m)
                })
                .collect();
            Ok(Value::Array(v))
        }
        "blockdev-reopen" => {
            let list = match a.map.remove("options") {
                Some(Value::Array(l)) => l,
                Some(_) => return Err(Args::type_error("options", "array")),
                None => return Err(QmpError::generic("Parameter 'options' is missing")),
            };
            a.finish()?;
            // Checked whole before anything changes.
            let mut todo = Vec::new();
            for o in list {
                let Value::Object(o) = o else {
                    return Err(Args::type_error("options", "object"));
                };
                let mut o = Args { map: o };
                let name = o.str_req("node-name")?;
                // As QEMU: options left out take their defaults, so no read-only is rw.
                let ro = o.bool_opt("read-only")?.unwrap_or(false);
                let st = state.borrow();
                let Some(node) = st.nodes.get(&name) else {
                    return Err(QmpError::generic(format!(
                        "Cannot find node named '{name}'"
                    )));
                };
                if let Some(Value::String(d)) = o.map.get("driver") {
                    if d != node.driver_name() {
                        return Err(QmpError::generic(format!(
                            "Cannot change the option 'driver' of node '{name}'"
                        )));
                    }
                }
                if let Some(k) = o.map.keys().find(|k| !REOPEN_KEPT.contains(&k.as_str())) {
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
        }
        "transaction" => {
            // QEMU's actions are backups, snapshots and dirty bitmaps, none of which stord
            // has; `abort` (which fails the transaction) is the one it can honour.
            let actions = match a.map.remove("actions") {
                Some(Value::Array(l)) => l,
                Some(_) => return Err(Args::type_error("actions", "array")),
                None => return Err(QmpError::generic("Parameter 'actions' is missing")),
            };
            let _ = a.map.remove("properties");
            a.finish()?;
            let mut abort = false;
            for act in &actions {
                match act.get("type").and_then(Value::as_str) {
                    Some("abort") => abort = true,
                    Some(t) => {
                        return Err(QmpError::generic(format!(
                            "transaction: action '{t}' is not supported by stord (supported: abort)"
                        )))
                    }
                    None => return Err(QmpError::generic("Parameter 'type' is missing")),
                }
            }
            if abort {
                return Err(QmpError::generic("Transaction aborted using Abort action"));
            }
            Ok(json!({}))
        }
        "quit" => {
            a.finish()?;
            let st = state.borrow();
            st.events.emit(
                "SHUTDOWN",
                json!({ "guest": false, "reason": "host-qmp-quit" }),
            );
            st.shutdown_announced.set(true);
            st.quit.set(true);
            Ok(json!({}))
        }
        other => Err(QmpError {
            class: "CommandNotFound",
            desc: format!("The command {other} has not been found"),
        }),
    }
}

/// QMP's nbd-server-start takes the legacy form: {"type": "unix", "data": {"path": ...}}.
fn socket_address_legacy(mut m: Map<String, Value>) -> Result<ListenAddr, QmpError> {
    let kind = match m.remove("type") {
        Some(Value::String(s)) => s,
        _ => return Err(QmpError::generic("Parameter 'addr.type' is missing")),
    };
    let data = match m.remove("data") {
        Some(Value::Object(d)) => d,
        _ => return Err(QmpError::generic("Parameter 'addr.data' is missing")),
    };
    let get = |k: &str| -> Result<String, QmpError> {
        match data.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(Args::type_error(&format!("addr.data.{k}"), "string")),
            None => Err(QmpError::generic(format!(
                "Parameter 'addr.data.{k}' is missing"
            ))),
        }
    };
    match kind.as_str() {
        "unix" => Ok(ListenAddr::Unix(get("path")?.into())),
        "inet" => {
            let port = get("port")?;
            let port = port.parse().map_err(|_| {
                QmpError::generic(format!(
                    "Parameter 'addr.data.port' expects a port number, got '{port}'"
                ))
            })?;
            Ok(ListenAddr::Inet(get("host")?, port))
        }
        other => Err(QmpError::generic(format!(
            "Parameter 'addr.type' does not accept value '{other}'"
        ))),
    }
}

fn object_id(path: &str) -> &str {
    path.strip_prefix("/objects/").unwrap_or(path)
}

fn query_iothreads(st: &State) -> Value {
    Value::Array(
        st.iothreads
            .iter()
            .map(|(id, obj)| {
                let r = obj.remote();
                let p = r.poll_params();
                let s = r.stats();
                let info = r.reactor_info();
                json!({
                    "id": id,
                    "thread-id": r.thread_id(),
                    "poll-max-ns": p.max_ns,
                    "poll-grow": p.grow,
                    "poll-shrink": p.shrink,
                    "poll-weight": p.weight,
                    "aio-max-batch": 0,
                    "poll-policy": p.policy.name(),
                    "x-stats": {
                        "reactor": info.kind,
                        "reactor-flags": info.flags,
                        "iterations": s.iterations,
                        "polls-attempted": s.polls_attempted,
                        "poll-hits": s.poll_hits,
                        "poll-misses": s.poll_misses,
                        "poll-ns": s.poll_ns,
                        "blocked-ns": s.blocked_ns,
                        "blocking-waits": s.blocking_waits,
                        "eventfd-wakeups": s.eventfd_wakeups,
                        "eventfd-writes": s.eventfd_writes,
                        "eventfd-writes-avoided": s.eventfd_writes_avoided,
                        "completions": s.completions,
                        "completions-per-iteration": s.completions_per_iteration,
                        "window-ns": s.window_ns,
                        "windows": s.windows.iter().map(|w| json!({ "name": w.name, "ns": w.ns })).collect::<Vec<_>>(),
                        "counters": s.counters.iter().map(|(n, v)| (n.clone(), json!(v))).collect::<Map<String, Value>>(),
                        "histograms": s.histograms.iter().map(|(n, h)| (n.clone(), json!(h))).collect::<Map<String, Value>>(),
                    },
                })
            })
            .collect(),
    )
}

fn qom_get(st: &State, path: &str, prop: &str) -> Result<Value, QmpError> {
    let id = object_id(path);
    let obj = st.iothreads.get(id).ok_or_else(|| QmpError {
        class: "DeviceNotFound",
        desc: format!("Device '{id}' not found"),
    })?;
    let p = obj.remote().poll_params();
    Ok(match prop {
        "poll-max-ns" => json!(p.max_ns),
        "poll-grow" => json!(p.grow),
        "poll-shrink" => json!(p.shrink),
        "poll-weight" => json!(p.weight),
        "poll-policy" => json!(p.policy.name()),
        "poll-grow-start" => json!(p.grow_start_ns),
        "poll-allow-shrink" => json!(p.allow_shrink),
        "poll-yield-ns" => json!(p.yield_ns),
        "aio-max-batch" => json!(0),
        "type" => json!("iothread"),
        other => {
            return Err(QmpError::generic(format!(
                "Property 'iothread.{other}' not found"
            )))
        }
    })
}

fn qom_set(st: &State, path: &str, prop: &str, value: Value) -> Result<(), QmpError> {
    let id = object_id(path);
    let obj = st.iothreads.get(id).ok_or_else(|| QmpError {
        class: "DeviceNotFound",
        desc: format!("Device '{id}' not found"),
    })?;
    let remote = obj.remote();
    let mut p = remote.poll_params();
    let int = |v: &Value| v.as_u64().ok_or_else(|| Args::type_error(prop, "integer"));
    match prop {
        "poll-max-ns" => p.max_ns = int(&value)?,
        "poll-grow" => p.grow = int(&value)?,
        "poll-shrink" => p.shrink = int(&value)?,
        "poll-weight" => {
            p.weight = u32::try_from(int(&value)?)
                .map_err(|_| QmpError::generic("poll-weight must be in 0..=63"))?
        }
        "poll-grow-start" => p.grow_start_ns = int(&value)?,
        "poll-yield-ns" => p.yield_ns = int(&value)?,
        "poll-allow-shrink" => {
            p.allow_shrink = value
                .as_bool()
                .ok_or_else(|| Args::type_error(prop, "boolean"))?
        }
        "poll-policy" => {
            let s = value
                .as_str()
                .ok_or_else(|| Args::type_error(prop, "string"))?;
            p.policy = s.parse().map_err(QmpError::generic)?;
        }
        "aio-max-batch" => {
            int(&value)?;
            return Ok(());
        }
        other => {
            return Err(QmpError::generic(format!(
                "Property 'iothread.{other}' not found"
            )))
        }
    }
    remote.set_poll_params(p).map_err(QmpError::generic)
}

fn query_named_block_nodes(st: &State) -> Value {
    Value::Array(
        st.nodes
            .values()
            .map(|n| {
                let file = n
                    .filename()
                    .unwrap_or_else(|| format!("{}://", n.driver_name()));
                let actual = n
                    .filename()
                    .and_then(|f| std::fs::metadata(f).ok())
                    .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                    .unwrap_or(0);
                json!({
                    "node-name": n.name,
                    "drv": n.driver_name(),
                    "ro": n.is_read_only(),
                    "file": file,
                    "encrypted": false,
                    "active": true,
                    "backing_file_depth": 0,
                    "detect_zeroes": "off",
                    "write_threshold": 0,
                    "bps": 0, "bps_rd": 0, "bps_wr": 0,
                    "iops": 0, "iops_rd": 0, "iops_wr": 0,
                    "cache": { "writeback": true, "direct": n.direct, "no-flush": false },
                    "image": {
                        "filename": file,
                        "format": n.driver_name(),
                        "virtual-size": n.size(),
                        "actual-size": actual,
                        "dirty-flag": false,
                    },
                })
            })
            .collect(),
    )
}
