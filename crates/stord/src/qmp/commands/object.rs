//! Objects: `object-add/del`, and the iothread's properties through `qom-get`, `qom-set`
//! and `query-iothreads` (all from [`crate::iothread::PROPERTIES`]).

use serde_json::{json, Map, Value};
use stord_aio::Remote;

use super::{opt, req, Command, EnumType, Ty};
use crate::iothread::{self, IoThreadConfig, PropertyError};
use crate::qmp::QmpError;

impl From<PropertyError> for QmpError {
    fn from(e: PropertyError) -> Self {
        QmpError::generic(e.to_string())
    }
}

/// QEMU's ObjectType: the types object-add takes, from the daemon's table (so
/// query-qmp-schema lists them, `monitor-qmp` among them, and an unknown one gets QEMU's
/// words).
static OBJECT_TYPE: EnumType = EnumType {
    name: "ObjectType",
    values: || crate::daemon::OBJECT_TYPES.iter().map(|t| t.name).collect(),
};

pub const OBJECT_ADD: Command = Command {
    name: "object-add",
    args: &[req("qom-type", Ty::Enum(&OBJECT_TYPE)), req("id", Ty::Str)],
    open: true,
    ret: Ty::Any,
    run: |state, a| {
        if a.rest().get("qom-type").and_then(Value::as_str) == Some("iothread") {
            iothread::check_json_types(a.rest())?;
        }
        state.borrow_mut().add_object(a.into_keyval("object-add"))?;
        Ok(json!({}))
    },
};

pub const OBJECT_DEL: Command = Command {
    name: "object-del",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        state.borrow_mut().del_object(&a.str_req("id")?)?;
        Ok(json!({}))
    },
};

/// The iothread a QOM path names (`/objects/ID` or `ID`).
fn iothread(state: &crate::daemon::State, path: &str) -> Result<Remote, QmpError> {
    let id = path.strip_prefix("/objects/").unwrap_or(path);
    state.iothread(id).cloned().ok_or_else(|| QmpError {
        class: "DeviceNotFound",
        desc: format!("Device '{id}' not found"),
    })
}

/// A running thread's configuration, as its properties read it.
fn config(r: &Remote) -> IoThreadConfig {
    IoThreadConfig {
        poll: r.poll_params(),
        reactor: r.reactor_info().kind.parse().unwrap_or_default(),
        sched_slice_ns: r.sched_slice_ns(),
    }
}

pub const QOM_GET: Command = Command {
    name: "qom-get",
    args: &[req("path", Ty::Str), req("property", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let r = iothread(&state.borrow(), &a.str_req("path")?)?;
        Ok(iothread::get(&config(&r), &a.str_req("property")?)?)
    },
};

pub const QOM_SET: Command = Command {
    name: "qom-set",
    args: &[
        req("path", Ty::Str),
        req("property", Ty::Str),
        req("value", Ty::Any),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let r = iothread(&state.borrow(), &a.str_req("path")?)?;
        let prop = a.str_req("property")?;
        let value = a.take("value").unwrap_or_default();
        let mut c = config(&r);
        iothread::set(&mut c, &prop, &value)?;
        r.set_poll_params(c.poll).map_err(QmpError::generic)?;
        Ok(json!({}))
    },
};

pub const QUERY_IOTHREADS: Command = Command {
    name: "query-iothreads",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        let st = state.borrow();
        Ok(Value::Array(
            st.iothreads()
                .map(|(id, r)| {
                    let mut m = Map::new();
                    m.insert("id".into(), id.into());
                    m.insert("thread-id".into(), r.thread_id().into());
                    iothread::query_fields(&config(r), &mut m);
                    m.insert("x-stats".into(), stats(r));
                    Value::Object(m)
                })
                .collect(),
        ))
    },
};

/// stord's own loop statistics for one thread.
fn stats(r: &Remote) -> Value {
    let s = r.stats();
    let info = r.reactor_info();
    json!({
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
        "ring-enters": s.ring_enters,
        "completions-per-iteration": s.completions_per_iteration,
        "window-ns": s.window_ns,
        "windows": s.windows.iter().map(|w| json!({ "name": w.name, "ns": w.ns })).collect::<Vec<_>>(),
        "counters": s.counters.iter().map(|(n, v)| (n.clone(), json!(v))).collect::<Map<String, Value>>(),
        "histograms": s.histograms.iter().map(|(n, h)| (n.clone(), json!(h))).collect::<Map<String, Value>>(),
    })
}

/// What a QOM path names (QEMU's object_resolve_path over the containers stord has).
enum QomPath {
    Root,
    /// `/objects` or `/chardevs`, with its children by name and type.
    Container(&'static str, Vec<(String, &'static str)>),
    /// An object or a chardev, of this type, with the property values stord reads (an
    /// iothread's settings, a monitor's).
    Object(&'static str, Vec<(&'static str, Value)>),
}

fn not_found(path: &str) -> QmpError {
    QmpError {
        class: "DeviceNotFound",
        desc: format!("Device '{path}' not found"),
    }
}

fn resolve(st: &crate::daemon::State, path: &str) -> Result<QomPath, QmpError> {
    let objects = st.object_types();
    let chardevs: Vec<(String, &'static str)> = st
        .chardev_table()
        .iter()
        .map(|(id, dev, _)| (id.to_string(), dev.type_name()))
        .collect();
    let find = |list: &[(String, &'static str)], id: &str| {
        list.iter().find(|(i, _)| i == id).map(|(_, t)| *t)
    };
    let object = |id: &str, t| QomPath::Object(t, object_values(st, id, t));
    let full = match path.strip_prefix('/') {
        Some(rest) => rest,
        None => {
            // A partial path: the one object or chardev of that name (or a container).
            return match (path, find(&objects, path), find(&chardevs, path)) {
                ("objects", ..) => Ok(QomPath::Container("objects", objects)),
                ("chardevs", ..) => Ok(QomPath::Container("chardevs", chardevs)),
                (_, Some(_), Some(_)) => {
                    Err(QmpError::generic(format!("Path '{path}' is ambiguous")))
                }
                (_, Some(t), None) => Ok(object(path, t)),
                (_, None, Some(t)) => Ok(QomPath::Object(t, Vec::new())),
                _ => Err(not_found(path)),
            };
        }
    };
    let parts: Vec<&str> = full.split('/').filter(|p| !p.is_empty()).collect();
    match parts[..] {
        [] => Ok(QomPath::Root),
        ["objects"] => Ok(QomPath::Container("objects", objects)),
        ["chardevs"] => Ok(QomPath::Container("chardevs", chardevs)),
        ["objects", id] => find(&objects, id)
            .map(|t| object(id, t))
            .ok_or_else(|| not_found(path)),
        ["chardevs", id] => find(&chardevs, id)
            .map(|t| QomPath::Object(t, Vec::new()))
            .ok_or_else(|| not_found(path)),
        _ => Err(not_found(path)),
    }
}

/// The property values of object `id` (of type `t`) that stord reads.
fn object_values(st: &crate::daemon::State, id: &str, t: &str) -> Vec<(&'static str, Value)> {
    if let Some(r) = st.iothread(id) {
        let c = config(r);
        return crate::qom::find(t)
            .map(crate::qom::properties)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(n, _)| iothread::get(&c, n).ok().map(|v| (n, v)))
            .collect();
    }
    st.monitor_properties(id).unwrap_or_default()
}

/// The properties at `path` in qom-list's order: name, QOM type, and the value where
/// stord reads it (QEMU's object_property_get_qobject: a type name, a child's canonical
/// path, an iothread's settings; None where the property cannot be read).
fn properties(
    st: &crate::daemon::State,
    path: &str,
) -> Result<Vec<(String, String, Option<Value>)>, QmpError> {
    let ty = |t: &str| (String::from("type"), "string".into(), Some(Value::from(t)));
    Ok(match resolve(st, path)? {
        QomPath::Root => vec![
            ty("container"),
            (
                "objects".into(),
                "child<container>".into(),
                Some("/objects".into()),
            ),
            (
                "chardevs".into(),
                "child<container>".into(),
                Some("/chardevs".into()),
            ),
        ],
        QomPath::Container(name, children) => std::iter::once(ty("container"))
            .chain(children.iter().map(|(id, t)| {
                let value = Value::from(format!("/{name}/{id}"));
                (id.clone(), format!("child<{t}>"), Some(value))
            }))
            .collect(),
        QomPath::Object(t, values) => crate::qom::find(t)
            .map(crate::qom::properties)
            .unwrap_or_default()
            .into_iter()
            .map(|(n, pt)| {
                let value = match n {
                    "type" => Some(Value::from(t)),
                    _ => values.iter().find(|(k, _)| *k == n).map(|(_, v)| v.clone()),
                };
                (n.to_string(), pt.to_string(), value)
            })
            .collect(),
    })
}

fn prop(name: &str, ty: &str) -> Value {
    json!({ "name": name, "type": ty })
}

pub const QOM_LIST: Command = Command {
    name: "qom-list",
    args: &[req("path", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let path = a.str_req("path")?;
        let list = properties(&state.borrow(), &path)?;
        Ok(Value::Array(
            list.iter().map(|(n, t, _)| prop(n, t)).collect(),
        ))
    },
};

/// QEMU 10.1's qom-list-get: for each path, its properties with their values (a value
/// left out where the property cannot be read); the first path that resolves to
/// nothing fails the whole command, as QEMU's does.
pub const QOM_LIST_GET: Command = Command {
    name: "qom-list-get",
    args: &[req("paths", Ty::Array)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let st = state.borrow();
        let mut out = Vec::new();
        for (i, path) in a.array("paths").unwrap_or_default().iter().enumerate() {
            let path = path
                .as_str()
                .ok_or_else(|| super::type_error(&format!("paths[{i}]"), "string"))?;
            let props: Vec<Value> = properties(&st, path)?
                .into_iter()
                .map(|(n, t, v)| {
                    let mut p = prop(&n, &t);
                    if let Some(v) = v {
                        p["value"] = v;
                    }
                    p
                })
                .collect();
            out.push(json!({ "properties": props }));
        }
        Ok(Value::Array(out))
    },
};

pub const QOM_LIST_TYPES: Command = Command {
    name: "qom-list-types",
    args: &[opt("implements", Ty::Str), opt("abstract", Ty::Bool)],
    open: false,
    ret: Ty::Any,
    run: |_, mut a| {
        let implements = a.str("implements");
        let with_abstract = a.bool("abstract").unwrap_or(false);
        Ok(Value::Array(
            crate::qom::list_types(implements.as_deref(), with_abstract)
                .into_iter()
                .map(|t| {
                    let mut v = json!({ "name": t.name });
                    if let Some(p) = t.parent {
                        v["parent"] = p.into();
                    }
                    if t.abstract_ {
                        v["abstract"] = true.into();
                    }
                    v
                })
                .collect(),
        ))
    },
};

pub const QOM_LIST_PROPERTIES: Command = Command {
    name: "qom-list-properties",
    args: &[req("typename", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |_, mut a| {
        let name = a.str_req("typename")?;
        let t = crate::qom::find(&name).ok_or_else(|| QmpError {
            class: "DeviceNotFound",
            desc: format!("Class '{name}' not found"),
        })?;
        if t.name == "interface" || t.parent == Some("interface") {
            return Err(QmpError::generic("Parameter 'typename' expects a QOM type"));
        }
        Ok(Value::Array(
            crate::qom::properties(t)
                .into_iter()
                .map(|(n, t)| prop(n, t))
                .collect(),
        ))
    },
};
