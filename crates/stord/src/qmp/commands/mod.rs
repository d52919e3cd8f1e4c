//! QMP commands as a table: each [`Command`] is a name, its argument schema and a small
//! handler over the daemon's API. The dispatcher checks the arguments against the schema
//! first (QEMU's messages: a missing, unexpected or mistyped argument), and `query-commands`
//! and `query-qmp-schema` are generated from the same table, so adding a command is one
//! entry and one function. Names, arguments and error texts follow qemu-storage-daemon's
//! schema where the two overlap.
//!
//! This file is the table (and the two commands that describe it); what a command is and
//! the arguments it gets are in [`command`], the schema built from a table in
//! [`introspect`]. The handlers live beside the concern they serve: [`block`] (nodes),
//! [`bitmap`] (dirty bitmaps), [`chardev`] (character devices and ringbufs), [`export`]
//! (exports and the NBD server), [`object`] (objects and iothread properties), [`job`]
//! (jobs and blockdev-create), [`control`] (the monitor itself and the process).

mod bitmap;
mod block;
mod chardev;
mod command;
mod control;
mod export;
mod introspect;
mod job;
mod object;

use serde_json::{json, Map, Value};

use super::QmpError;
use crate::daemon::SharedState;

pub use crate::schema::{opt, req, Arg, EnumType, Ty, UnionType};
pub use command::{missing, type_error, Args, Command};

/// Every command but `qmp_capabilities` (which the monitor answers during negotiation).
pub const COMMANDS: &[Command] = &[
    control::QUERY_VERSION,
    QUERY_COMMANDS,
    QUERY_QMP_SCHEMA,
    object::QUERY_IOTHREADS,
    object::QOM_GET,
    object::QOM_SET,
    object::QOM_LIST,
    object::QOM_LIST_GET,
    object::QOM_LIST_TYPES,
    object::QOM_LIST_PROPERTIES,
    object::OBJECT_ADD,
    object::OBJECT_DEL,
    block::BLOCKDEV_ADD,
    block::BLOCKDEV_DEL,
    block::QUERY_NAMED_BLOCK_NODES,
    block::QUERY_BLOCK,
    block::QUERY_BLOCKSTATS,
    bitmap::ADD,
    bitmap::REMOVE,
    bitmap::CLEAR,
    bitmap::ENABLE,
    bitmap::DISABLE,
    bitmap::MERGE,
    bitmap::SHA256,
    export::NBD_SERVER_START,
    export::NBD_SERVER_STOP,
    export::BLOCK_EXPORT_ADD,
    export::BLOCK_EXPORT_DEL,
    export::NBD_SERVER_ADD,
    export::NBD_SERVER_REMOVE,
    export::QUERY_BLOCK_EXPORTS,
    block::BLOCKDEV_REOPEN,
    block::BLOCKDEV_SET_ACTIVE,
    block::BLOCK_RESIZE,
    block::BLOCK_SET_WRITE_THRESHOLD,
    block::CHANGE_BACKING_FILE,
    block::X_BLOCKDEV_CHANGE,
    block::X_BLOCKDEV_SET_IOTHREAD,
    block::X_DEBUG_QUERY_BLOCK_GRAPH,
    job::BLOCKDEV_CREATE,
    job::X_BLOCKDEV_AMEND,
    job::QUERY_JOBS,
    job::JOB_DISMISS,
    job::JOB_FINALIZE,
    job::JOB_PAUSE,
    job::JOB_RESUME,
    job::JOB_CANCEL,
    job::JOB_COMPLETE,
    job::QUERY_BLOCK_JOBS,
    job::BLOCK_JOB_DISMISS,
    job::BLOCK_JOB_FINALIZE,
    job::BLOCK_JOB_PAUSE,
    job::BLOCK_JOB_RESUME,
    job::BLOCK_JOB_CANCEL,
    job::BLOCK_JOB_COMPLETE,
    job::BLOCK_JOB_SET_SPEED,
    job::BLOCK_JOB_CHANGE,
    job::BLOCK_STREAM,
    job::BLOCK_COMMIT,
    job::BLOCKDEV_MIRROR,
    job::BLOCKDEV_BACKUP,
    job::DRIVE_BACKUP,
    job::DRIVE_MIRROR,
    block::BLOCKDEV_SNAPSHOT,
    block::BLOCKDEV_SNAPSHOT_SYNC,
    block::BLOCKDEV_SNAPSHOT_INTERNAL_SYNC,
    block::BLOCKDEV_SNAPSHOT_DELETE_INTERNAL_SYNC,
    chardev::CHARDEV_ADD,
    chardev::CHARDEV_CHANGE,
    chardev::CHARDEV_REMOVE,
    chardev::CHARDEV_SEND_BREAK,
    chardev::QUERY_CHARDEV,
    chardev::QUERY_CHARDEV_BACKENDS,
    chardev::RINGBUF_READ,
    chardev::RINGBUF_WRITE,
    control::TRANSACTION,
    control::QUIT,
];

/// The command `name`.
pub fn command(name: &str) -> Option<&'static Command> {
    COMMANDS.iter().find(|c| c.name == name)
}

/// Runs one command.
pub fn execute(
    state: &SharedState,
    cmd: &str,
    args: Map<String, Value>,
) -> Result<Value, QmpError> {
    let Some(c) = command(cmd) else {
        return Err(QmpError {
            class: "CommandNotFound",
            desc: format!("The command {cmd} has not been found"),
        });
    };
    let args = Args::check(args, c.args, c.open)?;
    // Errors built for the command line name their option list (`--blockdev: `); read
    // from QMP, that list is the command, and QEMU's QMP texts never name it.
    (c.run)(state, args).map_err(|e| e.without_list_name(c.name))
}

/// `query-commands`: the table's names.
pub const QUERY_COMMANDS: Command = Command {
    name: "query-commands",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |_, _| {
        let names = std::iter::once("qmp_capabilities").chain(COMMANDS.iter().map(|c| c.name));
        Ok(Value::Array(names.map(|c| json!({ "name": c })).collect()))
    },
};

/// `query-qmp-schema`: the table described.
pub const QUERY_QMP_SCHEMA: Command = Command {
    name: "query-qmp-schema",
    args: &[],
    open: false,
    ret: Ty::Any,
    run: |_, _| Ok(schema()),
};

/// The schema of every command (see [`introspect::schema`]).
pub fn schema() -> Value {
    introspect::schema(COMMANDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_the_schema_describes_every_command() {
        let mut names: Vec<&str> = COMMANDS.iter().map(|c| c.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a command is in the table twice");
        let schema = schema();
        let list = schema.as_array().unwrap();
        let find = |name: &str| list.iter().find(|e| e["name"] == name).cloned();
        for c in COMMANDS {
            let info = find(c.name).unwrap_or_else(|| panic!("{} not in the schema", c.name));
            assert_eq!(info["meta-type"], "command");
            let args = find(info["arg-type"].as_str().unwrap()).unwrap();
            let members: Vec<&str> = args["members"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["name"].as_str().unwrap())
                .collect();
            for a in c.args {
                assert!(members.contains(&a.name), "{}: {}", c.name, a.name);
            }
        }
        assert_eq!(find("BLOCK_EXPORT_DELETED").unwrap()["meta-type"], "event");
        // Every type a member or variant names is in the list.
        for e in list.iter().filter(|e| e["meta-type"] == "object") {
            let variants = e["variants"].as_array().into_iter().flatten();
            for m in e["members"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(variants)
            {
                assert!(find(m["type"].as_str().unwrap()).is_some(), "{m}");
            }
        }
        // The driver enum and blockdev-create's union come from the driver table.
        let add = find(find("blockdev-add").unwrap()["arg-type"].as_str().unwrap()).unwrap();
        let driver = &add["members"][0];
        let drivers = find(driver["type"].as_str().unwrap()).unwrap();
        assert_eq!(drivers["meta-type"], "enum");
        assert_eq!(
            drivers["values"],
            json!(crate::block::drivers::all_driver_names())
        );
        let create = find(
            find("blockdev-create").unwrap()["arg-type"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        let options = find(create["members"][1]["type"].as_str().unwrap()).unwrap();
        assert_eq!(options["tag"], "driver");
        let cases: Vec<&str> = options["variants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["case"].as_str().unwrap())
            .collect();
        assert_eq!(cases, ["file", "qcow2", "luks", "rbd"]);
    }

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let spec = [req("a", Ty::Str), opt("b", Ty::Bool)];
        let m = |v: Value| v.as_object().unwrap().clone();
        let e = Args::check(m(json!({})), &spec, false).err().unwrap();
        assert_eq!(e.desc, "Parameter 'a' is missing");
        let e = Args::check(m(json!({"a": 1})), &spec, false).err().unwrap();
        assert_eq!(e.desc, "Invalid parameter type for 'a', expected: string");
        let e = Args::check(m(json!({"a": "x", "c": 1})), &spec, false)
            .err()
            .unwrap();
        assert_eq!(e.desc, "Parameter 'c' is unexpected");
        assert!(Args::check(m(json!({"a": "x", "c": 1})), &spec, true).is_ok());
        let mut a = Args::check(m(json!({"a": "x", "b": true})), &spec, false).unwrap();
        assert_eq!(a.str("a").as_deref(), Some("x"));
        assert_eq!(a.bool("b"), Some(true));
    }
}
