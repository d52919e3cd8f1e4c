//! Character devices over QMP: `chardev-add`, `-change`, `-remove`, `-send-break`,
//! `query-chardev`, `query-chardev-backends`, and `ringbuf-read`/`-write` (the bytes of a
//! ringbuf, raw text or base64, as QEMU reads and writes them).

use serde_json::{json, Value};

use super::{opt, req, Args, Command, EnumType, Ty};
use crate::chardev::log::{ChardevLog, LogOptions, SharedLog};
use crate::chardev::{Chardev, ChardevError, BACKENDS};
use crate::qmp::QmpError;

impl From<ChardevError> for QmpError {
    fn from(e: ChardevError) -> Self {
        QmpError::generic(e.to_string())
    }
}

/// QEMU's DataFormat.
static DATA_FORMAT: EnumType = EnumType {
    name: "DataFormat",
    values: || vec!["utf8", "base64"],
};

/// The backend, and its log opened (ChardevCommon's `logfile`, `logappend` and QEMU
/// 11.0's `logtimestamp`).
fn backend(a: &mut Args) -> Result<(Chardev, Option<SharedLog>), QmpError> {
    let b = a.take("backend").unwrap_or(Value::Null);
    let dev = Chardev::from_qmp(&b)?;
    let log = ChardevLog::open(&LogOptions::from_qmp(&b)).map_err(QmpError::generic)?;
    Ok((dev, log))
}

pub const CHARDEV_ADD: Command = Command {
    name: "chardev-add",
    args: &[req("id", Ty::Str), req("backend", Ty::Object)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("id")?;
        let (dev, log) = backend(&mut a)
            .map_err(|e| QmpError::generic(format!("Failed to add chardev '{id}': {}", e.desc)))?;
        let mut st = state.borrow_mut();
        st.chardevs().add_open(&id, dev)?;
        st.chardevs().set_log(&id, log);
        Ok(json!({}))
    },
};

pub const CHARDEV_CHANGE: Command = Command {
    name: "chardev-change",
    args: &[req("id", Ty::Str), req("backend", Ty::Object)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("id")?;
        if !state.borrow().chardev_table().contains(&id) {
            return Err(QmpError::generic(format!("Chardev '{id}' does not exist")));
        }
        let (dev, log) = backend(&mut a)?;
        let mut st = state.borrow_mut();
        st.chardevs().change(&id, dev)?;
        st.chardevs().set_log(&id, log);
        Ok(json!({}))
    },
};

pub const CHARDEV_REMOVE: Command = Command {
    name: "chardev-remove",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        state.borrow_mut().chardevs().remove(&a.str_req("id")?)?;
        Ok(json!({}))
    },
};

pub const CHARDEV_SEND_BREAK: Command = Command {
    name: "chardev-send-break",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("id")?;
        if !state.borrow().chardev_table().contains(&id) {
            return Err(QmpError::generic(format!("Chardev '{id}' not found")));
        }
        Ok(json!({}))
    },
};

pub const QUERY_CHARDEV: Command = Command {
    name: "query-chardev",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| {
        let st = state.borrow();
        Ok(Value::Array(
            st.chardev_table()
                .iter()
                .map(|(id, dev, used)| {
                    json!({ "label": id, "filename": dev.filename(used), "frontend-open": used })
                })
                .collect(),
        ))
    },
};

pub const QUERY_CHARDEV_BACKENDS: Command = Command {
    name: "query-chardev-backends",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |_, _| Ok(BACKENDS.iter().map(|b| json!({ "name": b })).collect()),
};

pub const RINGBUF_WRITE: Command = Command {
    name: "ringbuf-write",
    args: &[
        req("device", Ty::Str),
        req("data", Ty::Str),
        opt("format", Ty::Enum(&DATA_FORMAT)),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let device = a.str_req("device")?;
        let data = a.str_req("data")?;
        let base64 = a.str("format").as_deref() == Some("base64");
        let mut st = state.borrow_mut();
        let ring = st.chardevs().ringbuf(&device)?;
        let bytes = if base64 {
            openssl::base64::decode_block(&data)
                .map_err(|_| QmpError::generic("Base64 data contains invalid characters"))?
        } else {
            data.into_bytes()
        };
        // Not logged: QEMU's ringbuf-write puts the bytes in the ring past its chardev
        // layer (ringbuf_chr_write), and so past the log.
        ring.write(&bytes);
        Ok(json!({}))
    },
};

pub const RINGBUF_READ: Command = Command {
    name: "ringbuf-read",
    args: &[
        req("device", Ty::Str),
        req("size", Ty::Int),
        opt("format", Ty::Enum(&DATA_FORMAT)),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let device = a.str_req("device")?;
        let size = a.i64("size").unwrap_or(0);
        let base64 = a.str("format").as_deref() == Some("base64");
        let mut st = state.borrow_mut();
        let ring = st.chardevs().ringbuf(&device)?;
        if size <= 0 {
            return Err(QmpError::generic("size must be greater than zero"));
        }
        let bytes = ring.read(size as usize);
        Ok(Value::String(if base64 {
            openssl::base64::encode_block(&bytes)
        } else {
            // QEMU sends the bytes as they are, invalid UTF-8 replaced.
            String::from_utf8_lossy(&bytes).into_owned()
        }))
    },
};
