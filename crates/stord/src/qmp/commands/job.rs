//! Jobs: `blockdev-create`, `block-stream`, the `job-*` and `block-job-*` verbs,
//! `query-jobs` and `query-block-jobs`.

use serde_json::{json, Map, Value};

use super::{opt, req, Args, Command, Ty};
use crate::block::create::{FileCreate, Qcow2Create};
use crate::daemon::CreateOptions;
use crate::qmp::QmpError;

impl From<crate::job::JobError> for QmpError {
    fn from(e: crate::job::JobError) -> Self {
        QmpError {
            class: e.qmp_class(),
            desc: e.to_string(),
        }
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
        let o = create_options(options, &|id| state.borrow().secret(id))?;
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

const RBD_ARGS: &[super::Arg] = &[
    req("driver", Ty::Str),
    req("location", Ty::Object),
    req("size", Ty::Uint),
    opt("cluster-size", Ty::Uint),
    opt("encrypt", Ty::Any),
];

/// QEMU's BlockdevCreateOptions for the drivers stord creates; its messages for what
/// the schema refuses (names prefixed `options.`). `secret` looks up secret objects.
fn create_options(
    m: Map<String, Value>,
    secret: &dyn Fn(&str) -> Option<Vec<u8>>,
) -> Result<CreateOptions, QmpError> {
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
        "rbd" => {
            let mut a = Args::check(m, RBD_ARGS, false).map_err(prefix)?;
            if a.take("encrypt").is_some() {
                return unsupported("'encrypt'");
            }
            let Some(Value::Object(loc)) = a.take("location") else {
                return Err(super::missing("options.location"));
            };
            let mut kv = Args::from_map(loc).into_keyval("options.location");
            let location = crate::block::rbd::RbdOptions::from_kv(&mut kv, secret)
                .map_err(|e| QmpError::generic(e.to_string()))?;
            kv.finish().map_err(|e| QmpError::generic(e.to_string()))?;
            Ok(CreateOptions::Rbd {
                location,
                size: a.i64("size").unwrap_or(0) as u64,
                cluster_size: a.i64("cluster-size").map(|v| v as u64),
            })
        }
        "raw" | "null-co" | "null" | "throttle" | "host_device" => Err(QmpError::generic(
            "Driver does not support blockdev-create",
        )),
        other => Err(QmpError::generic(format!(
            "blockdev-create: stord cannot create images of driver '{other}' (it creates file, qcow2 and rbd)"
        ))),
    }
}

pub const QUERY_JOBS: Command = Command {
    name: "query-jobs",
    args: &[],
    open: false,
    run: |state, _| Ok(state.borrow().jobs().query()),
};

pub const QUERY_BLOCK_JOBS: Command = Command {
    name: "query-block-jobs",
    args: &[],
    open: false,
    run: |state, _| Ok(state.borrow().jobs().query_block()),
};

/// Applies a verb to the job named by argument `key` (`block`: as `block-job-*` commands
/// look jobs up, with their error class).
fn verb(
    state: &crate::daemon::SharedState,
    a: &mut Args,
    key: &str,
    block: bool,
    f: impl FnOnce(&crate::job::Jobs, &crate::job::Job) -> Result<(), crate::job::JobError>,
) -> Result<Value, QmpError> {
    let id = a.str_req(key)?;
    let st = state.borrow();
    let job = st.jobs().find(&id, block)?;
    f(st.jobs(), &job)?;
    Ok(json!({}))
}

pub const JOB_DISMISS: Command = Command {
    name: "job-dismiss",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.dismiss(job)),
};

pub const JOB_FINALIZE: Command = Command {
    name: "job-finalize",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.finalize(job)),
};

pub const JOB_PAUSE: Command = Command {
    name: "job-pause",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.pause(job)),
};

pub const JOB_RESUME: Command = Command {
    name: "job-resume",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.resume(job)),
};

pub const JOB_CANCEL: Command = Command {
    name: "job-cancel",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.cancel(job, true)),
};

pub const JOB_COMPLETE: Command = Command {
    name: "job-complete",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.complete(job)),
};

pub const BLOCK_JOB_DISMISS: Command = Command {
    name: "block-job-dismiss",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", true, |j, job| j.dismiss(job)),
};

pub const BLOCK_JOB_FINALIZE: Command = Command {
    name: "block-job-finalize",
    args: &[req("id", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "id", true, |j, job| j.finalize(job)),
};

pub const BLOCK_JOB_PAUSE: Command = Command {
    name: "block-job-pause",
    args: &[req("device", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.pause(job)),
};

pub const BLOCK_JOB_RESUME: Command = Command {
    name: "block-job-resume",
    args: &[req("device", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.resume(job)),
};

pub const BLOCK_JOB_CANCEL: Command = Command {
    name: "block-job-cancel",
    args: &[req("device", Ty::Str), opt("force", Ty::Bool)],
    open: false,
    run: |state, mut a| {
        let force = a.bool("force").unwrap_or(false);
        verb(state, &mut a, "device", true, |j, job| {
            j.block_cancel(job, force)
        })
    },
};

pub const BLOCK_JOB_COMPLETE: Command = Command {
    name: "block-job-complete",
    args: &[req("device", Ty::Str)],
    open: false,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.complete(job)),
};

pub const BLOCK_JOB_SET_SPEED: Command = Command {
    name: "block-job-set-speed",
    args: &[req("device", Ty::Str), req("speed", Ty::Int)],
    open: false,
    run: |state, mut a| {
        let speed = a.i64("speed").unwrap_or(0);
        verb(state, &mut a, "device", true, |j, job| {
            j.set_speed(job, speed)
        })
    },
};

pub const BLOCK_STREAM: Command = Command {
    name: "block-stream",
    args: &[
        opt("job-id", Ty::Str),
        req("device", Ty::Str),
        opt("base", Ty::Str),
        opt("base-node", Ty::Str),
        opt("backing-file", Ty::Str),
        opt("backing-mask-protocol", Ty::Bool),
        opt("bottom", Ty::Str),
        opt("speed", Ty::Int),
        opt("on-error", Ty::Str),
        opt("filter-node-name", Ty::Str),
        opt("auto-finalize", Ty::Bool),
        opt("auto-dismiss", Ty::Bool),
    ],
    open: false,
    run: |state, mut a| {
        let on_error = on_error(&mut a)?;
        let o = crate::daemon::StreamOptions {
            job_id: a.str("job-id"),
            device: a.str_req("device")?,
            base: a.str("base"),
            base_node: a.str("base-node"),
            backing_file: a.str("backing-file"),
            backing_mask_protocol: a.bool("backing-mask-protocol").unwrap_or(false),
            bottom: a.str("bottom"),
            speed: a.i64("speed").unwrap_or(0),
            on_error,
            filter_node_name: a.str("filter-node-name"),
            auto_finalize: a.bool("auto-finalize").unwrap_or(true),
            auto_dismiss: a.bool("auto-dismiss").unwrap_or(true),
        };
        state
            .borrow_mut()
            .block_stream(o, std::rc::Rc::downgrade(state))?;
        Ok(json!({}))
    },
};

pub const BLOCK_COMMIT: Command = Command {
    name: "block-commit",
    args: &[
        opt("job-id", Ty::Str),
        req("device", Ty::Str),
        opt("base-node", Ty::Str),
        opt("base", Ty::Str),
        opt("top-node", Ty::Str),
        opt("top", Ty::Str),
        opt("backing-file", Ty::Str),
        opt("backing-mask-protocol", Ty::Bool),
        opt("speed", Ty::Int),
        opt("on-error", Ty::Str),
        opt("filter-node-name", Ty::Str),
        opt("auto-finalize", Ty::Bool),
        opt("auto-dismiss", Ty::Bool),
    ],
    open: false,
    run: |state, mut a| {
        let o = crate::daemon::CommitOptions {
            job_id: a.str("job-id"),
            device: a.str_req("device")?,
            base_node: a.str("base-node"),
            base: a.str("base"),
            top_node: a.str("top-node"),
            top: a.str("top"),
            backing_file: a.str("backing-file"),
            backing_mask_protocol: a.bool("backing-mask-protocol").unwrap_or(false),
            speed: a.i64("speed").unwrap_or(0),
            on_error: on_error(&mut a)?,
            filter_node_name: a.str("filter-node-name"),
            auto_finalize: a.bool("auto-finalize").unwrap_or(true),
            auto_dismiss: a.bool("auto-dismiss").unwrap_or(true),
        };
        state
            .borrow_mut()
            .block_commit(o, std::rc::Rc::downgrade(state))?;
        Ok(json!({}))
    },
};

pub const BLOCKDEV_MIRROR: Command = Command {
    name: "blockdev-mirror",
    args: &[
        opt("job-id", Ty::Str),
        req("device", Ty::Str),
        req("target", Ty::Str),
        opt("replaces", Ty::Str),
        req("sync", Ty::Str),
        opt("speed", Ty::Int),
        opt("granularity", Ty::Int),
        opt("buf-size", Ty::Int),
        opt("on-source-error", Ty::Str),
        opt("on-target-error", Ty::Str),
        opt("filter-node-name", Ty::Str),
        opt("copy-mode", Ty::Str),
        opt("auto-finalize", Ty::Bool),
        opt("auto-dismiss", Ty::Bool),
    ],
    open: false,
    run: |state, mut a| {
        let sync = a.str_req("sync")?;
        if !matches!(
            sync.as_str(),
            "full" | "top" | "none" | "incremental" | "bitmap"
        ) {
            return Err(QmpError::generic(format!(
                "Parameter 'sync' does not accept value '{sync}'"
            )));
        }
        let copy_mode = a.str("copy-mode");
        if let Some(m) = &copy_mode {
            if !matches!(m.as_str(), "background" | "write-blocking") {
                return Err(QmpError::generic(format!(
                    "Parameter 'copy-mode' does not accept value '{m}'"
                )));
            }
        }
        let o = crate::daemon::MirrorOptions {
            job_id: a.str("job-id"),
            device: a.str_req("device")?,
            target: a.str_req("target")?,
            replaces: a.str("replaces"),
            sync,
            speed: a.i64("speed").unwrap_or(0),
            granularity: a.i64("granularity"),
            buf_size: a.i64("buf-size"),
            on_source_error: error_policy(&mut a, "on-source-error")?,
            on_target_error: error_policy(&mut a, "on-target-error")?,
            filter_node_name: a.str("filter-node-name"),
            copy_mode,
            auto_finalize: a.bool("auto-finalize").unwrap_or(true),
            auto_dismiss: a.bool("auto-dismiss").unwrap_or(true),
        };
        state
            .borrow_mut()
            .blockdev_mirror(o, std::rc::Rc::downgrade(state))?;
        Ok(json!({}))
    },
};

/// `on-error` (QEMU's BlockdevOnError; `report` when absent).
fn on_error(a: &mut Args) -> Result<crate::job::OnError, QmpError> {
    error_policy(a, "on-error")
}

/// A BlockdevOnError argument named `key`.
fn error_policy(a: &mut Args, key: &str) -> Result<crate::job::OnError, QmpError> {
    match a.str(key) {
        None => Ok(crate::job::OnError::Report),
        Some(s) => crate::job::OnError::parse(&s).ok_or_else(|| {
            QmpError::generic(format!("Parameter '{key}' does not accept value '{s}'"))
        }),
    }
}
