//! Jobs: `blockdev-create`, `block-stream`, the `job-*` and `block-job-*` verbs,
//! `query-jobs` and `query-block-jobs`.

use serde_json::{json, Map, Value};

use super::{opt, req, Args, Command, Ty};
use crate::block::create::Creation;
use crate::block::drivers;
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
    args: &[
        req("job-id", Ty::Str),
        req("options", Ty::Union(&drivers::BLOCKDEV_CREATE_OPTIONS)),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("job-id")?;
        let Some(Value::Object(options)) = a.take("options") else {
            return Err(super::missing("options"));
        };
        let creation = prepare_creation(state, options)?;
        state.borrow_mut().blockdev_create(&id, creation)?;
        Ok(json!({}))
    },
};

pub const X_BLOCKDEV_AMEND: Command = Command {
    name: "x-blockdev-amend",
    args: &[
        req("job-id", Ty::Str),
        req("node-name", Ty::Str),
        req("options", Ty::Union(&drivers::BLOCKDEV_AMEND_OPTIONS)),
        opt("force", Ty::Bool),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("job-id")?;
        let node = a.str_req("node-name")?;
        let Some(Value::Object(options)) = a.take("options") else {
            return Err(super::missing("options"));
        };
        let force = a.bool("force").unwrap_or(false);
        state
            .borrow_mut()
            .blockdev_amend(&id, &node, options, force)?;
        Ok(json!({}))
    },
};

/// The driver's preparation of `options` (checked against its members already): the
/// work the `create` job runs, or the command's error.
fn prepare_creation(
    state: &crate::daemon::SharedState,
    mut options: Map<String, Value>,
) -> Result<Creation, QmpError> {
    let driver = options.remove("driver");
    let driver = driver.as_ref().and_then(Value::as_str).unwrap_or_default();
    // Only a driver's own name creates (`host_device` opens what `file` creates, as QEMU).
    let Some(create) = drivers::driver(driver)
        .filter(|d| d.names[0] == driver)
        .and_then(|d| d.create)
    else {
        return Err(QmpError::generic("Driver does not support blockdev-create"));
    };
    let kv = Args::from_map(options).into_keyval("options");
    let st = state.borrow();
    (create.prepare)(kv, &*st).map_err(|e| QmpError::generic(e.to_string()))
}

pub const QUERY_JOBS: Command = Command {
    name: "query-jobs",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |state, _| Ok(state.borrow().jobs().query()),
};

pub const QUERY_BLOCK_JOBS: Command = Command {
    name: "query-block-jobs",
    args: &[],
    open: false,
    ret: Ty::Any,
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
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.dismiss(job)),
};

pub const JOB_FINALIZE: Command = Command {
    name: "job-finalize",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.finalize(job)),
};

pub const JOB_PAUSE: Command = Command {
    name: "job-pause",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.pause(job)),
};

pub const JOB_RESUME: Command = Command {
    name: "job-resume",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.resume(job)),
};

pub const JOB_CANCEL: Command = Command {
    name: "job-cancel",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.cancel(job, true)),
};

pub const JOB_COMPLETE: Command = Command {
    name: "job-complete",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", false, |j, job| j.complete(job)),
};

pub const BLOCK_JOB_DISMISS: Command = Command {
    name: "block-job-dismiss",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", true, |j, job| j.dismiss(job)),
};

pub const BLOCK_JOB_FINALIZE: Command = Command {
    name: "block-job-finalize",
    args: &[req("id", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "id", true, |j, job| j.finalize(job)),
};

pub const BLOCK_JOB_PAUSE: Command = Command {
    name: "block-job-pause",
    args: &[req("device", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.pause(job)),
};

pub const BLOCK_JOB_RESUME: Command = Command {
    name: "block-job-resume",
    args: &[req("device", Ty::Str)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.resume(job)),
};

pub const BLOCK_JOB_CANCEL: Command = Command {
    name: "block-job-cancel",
    args: &[req("device", Ty::Str), opt("force", Ty::Bool)],
    open: false,
    ret: Ty::Any,
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
    ret: Ty::Any,
    run: |state, mut a| verb(state, &mut a, "device", true, |j, job| j.complete(job)),
};

pub const BLOCK_JOB_SET_SPEED: Command = Command {
    name: "block-job-set-speed",
    args: &[req("device", Ty::Str), req("speed", Ty::Int)],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let speed = a.i64("speed").unwrap_or(0);
        verb(state, &mut a, "device", true, |j, job| {
            j.set_speed(job, speed)
        })
    },
};

/// QEMU's JobType.
static JOB_TYPE: super::EnumType = super::EnumType {
    name: "JobType",
    values: || {
        vec![
            "commit",
            "stream",
            "mirror",
            "backup",
            "create",
            "amend",
            "snapshot-load",
            "snapshot-save",
            "snapshot-delete",
        ]
    },
};

/// QEMU's MirrorCopyMode.
static COPY_MODE: super::EnumType = super::EnumType {
    name: "MirrorCopyMode",
    values: || vec!["background", "write-blocking"],
};

/// `block-job-change`: the options of the job's type (a mirror's `copy-mode`).
pub const BLOCK_JOB_CHANGE: Command = Command {
    name: "block-job-change",
    args: &[
        req("id", Ty::Str),
        req("type", Ty::Enum(&JOB_TYPE)),
        opt("copy-mode", Ty::Enum(&COPY_MODE)),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let id = a.str_req("id")?;
        let _ = a.str_req("type")?;
        let mut options = Map::new();
        if let Some(m) = a.str("copy-mode") {
            options.insert("copy-mode".into(), m.into());
        }
        let st = state.borrow();
        let jobs = st.jobs();
        let job = jobs.get_block(&id)?;
        jobs.change(&job, &options)?;
        Ok(json!({}))
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
    ret: Ty::Any,
    run: |state, mut a| {
        let on_error = on_error(&mut a)?;
        let o = crate::daemon::jobs::stream::StreamOptions {
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
    ret: Ty::Any,
    run: |state, mut a| {
        let o = crate::daemon::jobs::commit::CommitOptions {
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
        opt("target-is-zero", Ty::Bool),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let mut o = mirror_options(&mut a)?;
        o.target_is_zero = a.bool("target-is-zero").unwrap_or(false);
        state
            .borrow_mut()
            .blockdev_mirror(o, std::rc::Rc::downgrade(state))?;
        Ok(json!({}))
    },
};

/// The arguments blockdev-mirror and drive-mirror share.
fn mirror_options(a: &mut Args) -> Result<crate::daemon::jobs::mirror::MirrorOptions, QmpError> {
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
    Ok(crate::daemon::jobs::mirror::MirrorOptions {
        job_id: a.str("job-id"),
        device: a.str_req("device")?,
        target: a.str_req("target")?,
        replaces: a.str("replaces"),
        sync,
        speed: a.i64("speed").unwrap_or(0),
        granularity: a.i64("granularity"),
        buf_size: a.i64("buf-size"),
        on_source_error: error_policy(a, "on-source-error")?,
        on_target_error: error_policy(a, "on-target-error")?,
        filter_node_name: a.str("filter-node-name"),
        copy_mode,
        auto_finalize: a.bool("auto-finalize").unwrap_or(true),
        auto_dismiss: a.bool("auto-dismiss").unwrap_or(true),
        target_fresh: false,
        target_is_zero: false,
    })
}

/// QEMU's NewImageMode: whether the image exists already.
fn existing(a: &mut Args) -> Result<bool, QmpError> {
    match a.str("mode").as_deref() {
        None | Some("absolute-paths") => Ok(false),
        Some("existing") => Ok(true),
        Some(m) => Err(QmpError::generic(format!(
            "Parameter 'mode' does not accept value '{m}'"
        ))),
    }
}

pub const DRIVE_MIRROR: Command = Command {
    name: "drive-mirror",
    args: &[
        opt("job-id", Ty::Str),
        req("device", Ty::Str),
        req("target", Ty::Str),
        opt("format", Ty::Str),
        opt("node-name", Ty::Str),
        opt("replaces", Ty::Str),
        req("sync", Ty::Str),
        opt("mode", Ty::Str),
        opt("speed", Ty::Int),
        opt("granularity", Ty::Int),
        opt("buf-size", Ty::Int),
        opt("on-source-error", Ty::Str),
        opt("on-target-error", Ty::Str),
        opt("unmap", Ty::Bool),
        opt("copy-mode", Ty::Str),
        opt("auto-finalize", Ty::Bool),
        opt("auto-dismiss", Ty::Bool),
    ],
    open: false,
    ret: Ty::Any,
    run: |state, mut a| {
        let t = crate::daemon::jobs::drive::DriveTarget {
            path: String::new(),
            format: a.str("format"),
            existing: existing(&mut a)?,
            node_name: a.str("node-name"),
        };
        let _ = a.bool("unmap");
        let o = mirror_options(&mut a)?;
        let t = crate::daemon::jobs::drive::DriveTarget {
            path: o.target.clone(),
            ..t
        };
        state
            .borrow_mut()
            .drive_mirror(o, t, std::rc::Rc::downgrade(state))?;
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

/// QEMU's MirrorSyncMode.
static SYNC_MODE: super::EnumType = super::EnumType {
    name: "MirrorSyncMode",
    values: || vec!["top", "full", "none", "incremental", "bitmap"],
};

/// QEMU's BitmapSyncMode.
static BITMAP_SYNC_MODE: super::EnumType = super::EnumType {
    name: "BitmapSyncMode",
    values: || vec!["on-success", "never", "always"],
};

/// QEMU's BackupCommon and the target, then what a form adds (drive-backup's image).
macro_rules! backup_args {
    ($($extra:expr),*) => {
        &[
            opt("job-id", Ty::Str),
            req("device", Ty::Str),
            req("sync", Ty::Enum(&SYNC_MODE)),
            opt("speed", Ty::Int),
            opt("bitmap", Ty::Str),
            opt("bitmap-mode", Ty::Enum(&BITMAP_SYNC_MODE)),
            opt("compress", Ty::Bool),
            opt("on-source-error", Ty::Str),
            opt("on-target-error", Ty::Str),
            opt("auto-finalize", Ty::Bool),
            opt("auto-dismiss", Ty::Bool),
            opt("filter-node-name", Ty::Str),
            opt("discard-source", Ty::Bool),
            opt("x-perf", Ty::Object),
            req("target", Ty::Str),
            $($extra),*
        ]
    };
}

/// Either backup command: the point in time made while no export request is inside
/// the graph, then the job started.
fn backup_command(
    state: &crate::daemon::SharedState,
    a: Args,
    drive: bool,
) -> Result<Value, QmpError> {
    let _held = crate::daemon::snapshot::hold_all_exports(state);
    let p = prepare_backup(state, a, drive)?;
    state
        .borrow_mut()
        .start_backup(p, std::rc::Rc::downgrade(state))?;
    Ok(json!({}))
}

pub const BLOCKDEV_BACKUP: Command = Command {
    name: "blockdev-backup",
    args: backup_args!(),
    open: false,
    ret: Ty::Any,
    run: |state, a| backup_command(state, a, false),
};

pub const DRIVE_BACKUP: Command = Command {
    name: "drive-backup",
    args: backup_args!(opt("format", Ty::Str), opt("mode", Ty::Str)),
    open: false,
    ret: Ty::Any,
    run: |state, a| backup_command(state, a, true),
};

/// A `blockdev-backup` or `drive-backup` (command or transaction action) made, not
/// started.
pub fn prepare_backup(
    state: &crate::daemon::SharedState,
    mut a: Args,
    drive: bool,
) -> Result<crate::daemon::jobs::backup::PreparedBackup, QmpError> {
    let target = if drive {
        Some(crate::daemon::jobs::drive::DriveTarget {
            path: String::new(),
            format: a.str("format"),
            existing: existing(&mut a)?,
            node_name: None,
        })
    } else {
        None
    };
    let bitmap_mode = a
        .str("bitmap-mode")
        .map(|m| crate::job::backup::BitmapMode::parse(&m).expect("checked by the schema"));
    let perf = match a.take("x-perf") {
        Some(Value::Object(p)) => backup_perf(p)?,
        _ => Default::default(),
    };
    let o = crate::daemon::jobs::backup::BackupOptions {
        job_id: a.str("job-id"),
        device: a.str_req("device")?,
        target: a.str_req("target")?,
        sync: a.str_req("sync")?,
        speed: a.i64("speed").unwrap_or(0),
        bitmap: a.str("bitmap"),
        bitmap_mode,
        compress: a.bool("compress").unwrap_or(false),
        on_source_error: error_policy(&mut a, "on-source-error")?,
        on_target_error: error_policy(&mut a, "on-target-error")?,
        auto_finalize: a.bool("auto-finalize").unwrap_or(true),
        auto_dismiss: a.bool("auto-dismiss").unwrap_or(true),
        filter_node_name: a.str("filter-node-name"),
        discard_source: a.bool("discard-source").unwrap_or(false),
        perf,
    };
    let mut st = state.borrow_mut();
    Ok(match target {
        Some(t) => {
            let t = crate::daemon::jobs::drive::DriveTarget {
                path: o.target.clone(),
                ..t
            };
            st.drive_backup(o, t, std::rc::Rc::downgrade(state))?
        }
        None => st.blockdev_backup(o)?,
    })
}

/// QEMU's BackupPerf members, checked as the schema declares them.
const BACKUP_PERF: &[super::Arg] = &[
    opt("use-copy-range", Ty::Bool),
    opt("max-workers", Ty::Int),
    opt("max-chunk", Ty::Int),
    opt("min-cluster-size", Ty::Uint),
];

fn backup_perf(p: Map<String, Value>) -> Result<crate::daemon::jobs::backup::BackupPerf, QmpError> {
    let mut p = Args::check_nested(p, BACKUP_PERF, "x-perf")?;
    Ok(crate::daemon::jobs::backup::BackupPerf {
        max_workers: p.i64("max-workers"),
        max_chunk: p.i64("max-chunk"),
        min_cluster_size: p.i64("min-cluster-size").map(|v| v as u64),
    })
}

/// The `blockdev-backup` and `drive-backup` transaction actions: made at prepare (the point in time shared
/// with the other actions), started at commit, dropped on abort.
pub fn backup_action(
    state: &crate::daemon::SharedState,
    ty: &str,
    data: Map<String, Value>,
) -> Option<Result<super::bitmap::Prepared, QmpError>> {
    let drive = match ty {
        "blockdev-backup" => false,
        "drive-backup" => true,
        _ => return None,
    };
    let run = || {
        let spec = if drive {
            DRIVE_BACKUP.args
        } else {
            BLOCKDEV_BACKUP.args
        };
        let a = Args::check(data, spec, false)?;
        let prepared = std::cell::RefCell::new(Some(prepare_backup(state, a, drive)?));
        let prepared = std::rc::Rc::new(prepared);
        let (st, p) = (state.clone(), prepared.clone());
        Ok(super::bitmap::Prepared {
            abort: Box::new(move || {
                if let Some(p) = prepared.borrow_mut().take() {
                    p.abort();
                }
            }),
            commit: Box::new(move || {
                if let Some(b) = p.borrow_mut().take() {
                    if let Err(e) = st.borrow_mut().start_backup(b, std::rc::Rc::downgrade(&st)) {
                        tracing::error!("transaction: the backup job did not start: {e}");
                    }
                }
            }),
        })
    };
    Some(run())
}
