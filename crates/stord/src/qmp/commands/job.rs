//! Jobs: `blockdev-create`, `query-jobs`, `job-dismiss`, `job-finalize`.

use serde_json::{json, Map, Value};

use super::{opt, req, Args, Command, Ty};
use crate::block::create::{FileCreate, Qcow2Create};
use crate::daemon::CreateOptions;
use crate::qmp::QmpError;

impl From<crate::job::JobError> for QmpError {
    fn from(e: crate::job::JobError) -> Self {
        QmpError::generic(e.to_string())
    }
}

pub const BLOCKDEV_CREATE: Command = Command {
    name: "blockdev-create",
    args: &[req("job-id", Ty::Str), req("options", Ty::Object)],
    open: false,
    run: |state, mut a| {
        let id = a.str_req("job-id")?;
        let Some(Value::Object(options)) = a.take("options") else {
            return Err(super::missing("options"));
        };
        let o = create_options(options)?;
        state.borrow_mut().blockdev_create(&id, o)?;
        Ok(json!({}))
    },
};

/// The members `options` takes for each driver stord creates, as QEMU's schema.
const FILE_ARGS: &[super::Arg] = &[
    req("driver", Ty::Str),
    req("filename", Ty::Str),
    req("size", Ty::Uint),
    opt("preallocation", Ty::Str),
    opt("nocow", Ty::Bool),
    opt("extent-size-hint", Ty::Uint),
];
const QCOW2_ARGS: &[super::Arg] = &[
    req("driver", Ty::Str),
    req("file", Ty::Any),
    req("size", Ty::Uint),
    opt("data-file", Ty::Any),
    opt("data-file-raw", Ty::Bool),
    opt("extended-l2", Ty::Bool),
    opt("version", Ty::Str),
    opt("backing-file", Ty::Str),
    opt("backing-fmt", Ty::Str),
    opt("encrypt", Ty::Any),
    opt("cluster-size", Ty::Uint),
    opt("preallocation", Ty::Str),
    opt("lazy-refcounts", Ty::Bool),
    opt("refcount-bits", Ty::Uint),
    opt("compression-type", Ty::Str),
];

/// QEMU's BlockdevCreateOptions for the drivers stord creates; its messages for what
/// the schema refuses (names prefixed `options.`).
fn create_options(m: Map<String, Value>) -> Result<CreateOptions, QmpError> {
    let prefix = |e: QmpError| QmpError::generic(e.desc.replacen("'", "'options.", 1));
    let driver = match m.get("driver") {
        Some(Value::String(d)) => d.clone(),
        Some(_) => return Err(super::type_error("options.driver", "string")),
        None => return Err(super::missing("options.driver")),
    };
    let unsupported = |what: &str| {
        Err(QmpError::generic(format!(
            "blockdev-create: {what} is not supported by stord yet"
        )))
    };
    match driver.as_str() {
        "file" => {
            let mut a = Args::check(m, FILE_ARGS, false).map_err(prefix)?;
            let falloc = match a.str("preallocation").as_deref() {
                None | Some("off") => false,
                Some("falloc") => true,
                Some(p) => return unsupported(&format!("preallocation={p}")),
            };
            Ok(CreateOptions::File(FileCreate {
                filename: a.str_req("filename")?,
                size: a.i64("size").unwrap_or(0) as u64,
                falloc,
            }))
        }
        "qcow2" => {
            let mut a = Args::check(m, QCOW2_ARGS, false).map_err(prefix)?;
            let file = match a.take("file") {
                Some(Value::String(f)) => f,
                _ => return unsupported("an inline 'file' (name a node)"),
            };
            for k in ["data-file", "encrypt"] {
                if a.take(k).is_some() {
                    return unsupported(&format!("'{k}'"));
                }
            }
            for k in ["data-file-raw", "extended-l2"] {
                if a.bool(k) == Some(true) {
                    return unsupported(&format!("'{k}'"));
                }
            }
            let v3 = match a.str("version").as_deref() {
                None | Some("v3") => true,
                Some("v2") => false,
                Some(v) => {
                    return Err(QmpError::generic(format!(
                        "Parameter 'options.version' does not accept value '{v}'"
                    )))
                }
            };
            match a.str("preallocation").as_deref() {
                None | Some("off") => {}
                Some(p) => return unsupported(&format!("preallocation={p}")),
            }
            let zstd = match a.str("compression-type").as_deref() {
                None | Some("zlib") => false,
                Some("zstd") => true,
                Some(c) => {
                    return Err(QmpError::generic(format!(
                        "Parameter 'options.compression-type' does not accept value '{c}'"
                    )))
                }
            };
            let uint = |a: &mut Args, k: &str, d: u64| a.i64(k).map_or(d, |v| v as u64);
            Ok(CreateOptions::Qcow2 {
                file,
                opts: Qcow2Create {
                    size: uint(&mut a, "size", 0),
                    v3,
                    cluster_size: uint(&mut a, "cluster-size", 65536),
                    refcount_bits: uint(&mut a, "refcount-bits", 16),
                    lazy_refcounts: a.bool("lazy-refcounts").unwrap_or(false),
                    backing_file: a.str("backing-file"),
                    backing_fmt: a.str("backing-fmt"),
                    zstd,
                },
            })
        }
        "raw" | "null-co" | "null" | "throttle" | "host_device" => Err(QmpError::generic(
            "Driver does not support blockdev-create",
        )),
        other => Err(QmpError::generic(format!(
            "blockdev-create: stord cannot create images of driver '{other}' (it creates file and qcow2)"
        ))),
    }
}

pub const QUERY_JOBS: Command = Command {
    name: "query-jobs",
    args: &[],
    open: false,
    run: |state, _| Ok(state.borrow().jobs().query()),
};

pub const JOB_DISMISS: Command = Command {
    name: "job-dismiss",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| {
        state.borrow().jobs().dismiss(&a.str_req("id")?)?;
        Ok(json!({}))
    },
};

pub const JOB_FINALIZE: Command = Command {
    name: "job-finalize",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| {
        state.borrow().jobs().finalize(&a.str_req("id")?)?;
        Ok(json!({}))
    },
};
