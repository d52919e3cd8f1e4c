//! Exports and the NBD server: `nbd-server-start/stop`, `block-export-add/del`,
//! `query-block-exports`.

use serde_json::{json, Map, Value};

use super::{opt, req, type_error, Command, EnumType, Ty, UnionType};
use crate::export::nbd::options::NbdServerOpts;
use crate::qmp::QmpError;

/// QEMU's InetSocketAddress, the members stord takes (10.1's keep-alive ones included).
const INET_SOCKET_ADDRESS: &[super::Arg] = &[
    req("host", Ty::Str),
    req("port", Ty::Str),
    opt("keep-alive", Ty::Bool),
    opt("keep-alive-count", Ty::Uint),
    opt("keep-alive-idle", Ty::Uint),
    opt("keep-alive-interval", Ty::Uint),
];

/// QEMU's UnixSocketAddress, the member stord takes.
const UNIX_SOCKET_ADDRESS: &[super::Arg] = &[req("path", Ty::Str)];

static SOCKET_ADDRESS_TYPE: EnumType = EnumType {
    name: "SocketAddressType",
    values: || vec!["inet", "unix", "vsock", "fd"],
};

/// QEMU's SocketAddressLegacy, nbd-server-start's `addr` (vsock and fd are refused when
/// the server starts).
static SOCKET_ADDRESS_LEGACY: UnionType = UnionType {
    name: "SocketAddressLegacy",
    tag: "type",
    tag_type: &SOCKET_ADDRESS_TYPE,
    variants: || {
        vec![
            ("inet", INET_WRAPPER),
            ("unix", UNIX_WRAPPER),
            ("vsock", OTHER_WRAPPER),
            ("fd", OTHER_WRAPPER),
        ]
    },
};
const INET_WRAPPER: &[super::Arg] = &[req("data", Ty::Struct(INET_SOCKET_ADDRESS))];
const UNIX_WRAPPER: &[super::Arg] = &[req("data", Ty::Struct(UNIX_SOCKET_ADDRESS))];
const OTHER_WRAPPER: &[super::Arg] = &[req("data", Ty::Object)];

pub const NBD_SERVER_START: Command = Command {
    name: "nbd-server-start",
    args: &[
        req("addr", Ty::Union(&SOCKET_ADDRESS_LEGACY)),
        opt("max-connections", Ty::Uint),
        opt("handshake-max-seconds", Ty::Uint),
        opt("tls-creds", Ty::Str),
        opt("tls-authz", Ty::Str),
        opt("x-buffer-limit", Ty::Uint),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, a| {
        let opts = NbdServerOpts::from_options(a.into_keyval("nbd-server-start"))?;
        stord_aio::with_current_context(|ctx| state.borrow_mut().start_nbd_server(ctx, opts))
            .ok_or_else(|| QmpError::generic("nbd-server-start outside the main loop"))??;
        Ok(json!({}))
    },
};

pub const NBD_SERVER_STOP: Command = Command {
    name: "nbd-server-stop",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        state.borrow_mut().stop_nbd_server()?;
        Ok(json!({}))
    },
};

pub const BLOCK_EXPORT_ADD: Command = Command {
    name: "block-export-add",
    args: &[
        req("type", Ty::Str),
        req("id", Ty::Str),
        req("node-name", Ty::Str),
        opt("name", Ty::Str),
        opt("description", Ty::Str),
        opt("iothread", Ty::Any),
        opt("mountpoint", Ty::Str),
        opt("writable", Ty::Bool),
        opt("writethrough", Ty::Bool),
        opt("fixed-iothread", Ty::Bool),
        opt("allocation-depth", Ty::Bool),
        opt("bitmaps", Ty::Array),
    ],
    open: true,
    ret: Ty::Any,
    run: |state, mut a| {
        // bitmaps: names or {node, name} objects, as bitmaps.0=..., bitmaps.1.node=...
        if let Some(Value::Array(list)) = a.take("bitmaps") {
            let mut o = serde_json::Map::new();
            for (i, b) in list.into_iter().enumerate() {
                if !(b.is_string() || b.is_object()) {
                    return Err(type_error("bitmaps", "string or object"));
                }
                o.insert(i.to_string(), b);
            }
            a.insert("bitmaps".into(), Value::Object(o));
        }
        match a.take("iothread") {
            // A list of iothreads (FUSE multi-queue): iothread.0, iothread.1, ...
            Some(Value::Array(list)) => {
                for (i, t) in list.into_iter().enumerate() {
                    if !t.is_string() {
                        return Err(type_error("iothread", "string"));
                    }
                    a.insert(format!("iothread.{i}"), t);
                }
            }
            Some(t @ Value::String(_)) => a.insert("iothread".into(), t),
            Some(_) => return Err(type_error("iothread", "string")),
            None => {}
        }
        state
            .borrow_mut()
            .add_export(a.into_keyval("block-export-add"))?;
        Ok(json!({}))
    },
};

/// The older way to export over NBD (libvirt before block-export-add): an NBD export
/// whose id is its name, a read-only node quietly exported read-only (QEMU's
/// qmp_nbd_server_add).
pub const NBD_SERVER_ADD: Command = Command {
    name: "nbd-server-add",
    args: &[
        req("device", Ty::Str),
        opt("name", Ty::Str),
        opt("description", Ty::Str),
        opt("writable", Ty::Bool),
        opt("bitmap", Ty::Str),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        if !state.borrow().nbd_server_running() {
            return Err(QmpError::generic("NBD server not running"));
        }
        let device = a.str_req("device")?;
        let name = a.str("name").unwrap_or_else(|| device.clone());
        let read_only = state
            .borrow()
            .node(&device)
            .is_some_and(|n| n.is_read_only());
        let mut o = Map::new();
        o.insert("type".into(), "nbd".into());
        o.insert("id".into(), name.clone().into());
        o.insert("node-name".into(), device.into());
        o.insert("name".into(), name.into());
        if let Some(d) = a.str("description") {
            o.insert("description".into(), d.into());
        }
        o.insert(
            "writable".into(),
            (a.bool("writable").unwrap_or(false) && !read_only).into(),
        );
        if let Some(b) = a.str("bitmap") {
            o.insert("bitmaps".into(), json!({ "0": b }));
        }
        let kv = super::Args::from_map(o).into_keyval("nbd-server-add");
        state.borrow_mut().add_export(kv)?;
        Ok(json!({}))
    },
};

pub const NBD_SERVER_REMOVE: Command = Command {
    name: "nbd-server-remove",
    args: &[req("name", Ty::Str), opt("mode", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let name = a.str_req("name")?;
        if let Some(e) = state.borrow().exports().find(|e| e.id() == name) {
            if e.kind() != "nbd" {
                return Err(QmpError::generic(format!(
                    "Export '{name}' is not an NBD export"
                )));
            }
        }
        let hard = export_del_mode(&mut a)?;
        state.borrow_mut().del_export(&name, hard)?;
        Ok(json!({}))
    },
};

/// `mode` of an export's removal: hard (clients cut off) or safe (the default).
fn export_del_mode(a: &mut super::Args) -> Result<bool, QmpError> {
    match a.str("mode").as_deref() {
        None | Some("safe") => Ok(false),
        Some("hard") => Ok(true),
        Some(m) => Err(QmpError::generic(format!(
            "Parameter 'mode' does not accept value '{m}'"
        ))),
    }
}

pub const BLOCK_EXPORT_DEL: Command = Command {
    name: "block-export-del",
    args: &[req("id", Ty::Str), opt("mode", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("id")?;
        let hard = export_del_mode(&mut a)?;
        state.borrow_mut().del_export(&id, hard)?;
        Ok(json!({}))
    },
};

pub const QUERY_BLOCK_EXPORTS: Command = Command {
    name: "query-block-exports",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        let st = state.borrow();
        let v: Vec<Value> = st
            .exports()
            .map(|e| {
                let mut m = Map::new();
                m.insert("type".into(), e.kind().into());
                m.insert("id".into(), e.id().into());
                m.insert("node-name".into(), e.node().name.clone().into());
                m.insert("shutting-down".into(), e.shutting_down().into());
                e.describe(&mut m);
                Value::Object(m)
            })
            .collect();
        Ok(Value::Array(v))
    },
};
