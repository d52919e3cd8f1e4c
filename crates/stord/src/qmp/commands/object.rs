//! Objects: `object-add/del`, and the iothread's properties through `qom-get`, `qom-set`
//! and `query-iothreads` (all from [`crate::iothread::PROPERTIES`]).

use serde_json::{json, Map, Value};
use stord_aio::Remote;

use super::{req, Command, Ty};
use crate::iothread::{self, IoThreadConfig, PropertyError};
use crate::qmp::QmpError;

impl From<PropertyError> for QmpError {
    fn from(e: PropertyError) -> Self {
        QmpError::generic(e.to_string())
    }
}

pub const OBJECT_ADD: Command = Command {
    name: "object-add",
    args: &[req("qom-type", Ty::Str), req("id", Ty::Str)],
    open: true,
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
    }
}

pub const QOM_GET: Command = Command {
    name: "qom-get",
    args: &[req("path", Ty::Str), req("property", Ty::Str)],
    open: false,
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
        "completions-per-iteration": s.completions_per_iteration,
        "window-ns": s.window_ns,
        "windows": s.windows.iter().map(|w| json!({ "name": w.name, "ns": w.ns })).collect::<Vec<_>>(),
        "counters": s.counters.iter().map(|(n, v)| (n.clone(), json!(v))).collect::<Map<String, Value>>(),
        "histograms": s.histograms.iter().map(|(n, h)| (n.clone(), json!(h))).collect::<Map<String, Value>>(),
    })
}
