//! QMP commands as a table: each [`Command`] is a name, its argument schema and a small
//! handler over the daemon's API. The dispatcher checks the arguments against the schema
//! first (QEMU's messages: a missing, unexpected or mistyped argument), and `query-commands`
//! and `query-qmp-schema` are generated from the same table, so adding a command is one
//! entry and one function. Names, arguments and error texts follow qemu-storage-daemon's
//! schema where the two overlap.
//!
//! The handlers live beside the concern they serve: [`block`] (nodes), [`bitmap`] (dirty
//! bitmaps), [`chardev`] (character devices and ringbufs), [`export`] (exports
//! and the NBD server), [`object`] (objects and iothread properties), [`job`] (jobs and
//! blockdev-create), [`control`] (the monitor itself and the process).

mod bitmap;
mod block;
mod chardev;
mod control;
mod export;
mod job;
mod object;

use serde_json::{json, Map, Value};

use super::QmpError;
use crate::cli::keyval::KeyVal;
use crate::daemon::SharedState;

use crate::schema::Mismatch;
pub use crate::schema::{opt, req, Arg, EnumType, Ty, UnionType};

/// A command's handler: its checked arguments in, a return value or an error out.
pub type Handler = fn(&SharedState, Args) -> Result<Value, QmpError>;

/// One QMP command.
pub struct Command {
    pub name: &'static str,
    pub args: &'static [Arg],
    /// Takes arguments beyond `args` (a driver's, an object type's or an export type's
    /// options, checked by the daemon when it builds the thing).
    pub open: bool,
    pub run: Handler,
}

/// Every command but `qmp_capabilities` (which the monitor answers during negotiation).
pub const COMMANDS: &[Command] = &[
    control::QUERY_VERSION,
    control::QUERY_COMMANDS,
    control::QUERY_QMP_SCHEMA,
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

/// A command's arguments, checked against its schema: typed getters cannot meet a wrong
/// type for a declared argument.
pub struct Args {
    map: Map<String, Value>,
}

/// QEMU's "Invalid parameter type" error.
pub fn type_error(name: &str, expected: &str) -> QmpError {
    QmpError::generic(format!(
        "Invalid parameter type for '{name}', expected: {expected}"
    ))
}

/// QEMU's words for a string that is no value of its enum.
pub fn bad_enum_value(name: &str, value: &str) -> QmpError {
    QmpError::generic(format!(
        "Parameter '{name}' does not accept value '{value}'"
    ))
}

/// QEMU's "Parameter ... is missing".
pub fn missing(name: &str) -> QmpError {
    QmpError::generic(format!("Parameter '{name}' is missing"))
}

impl Args {
    /// Checks `map` against `spec`: required arguments present, declared ones of their
    /// type, no others unless `open`.
    fn check(map: Map<String, Value>, spec: &[Arg], open: bool) -> Result<Self, QmpError> {
        check_members(&map, spec, open, "")?;
        Ok(Self { map })
    }

    /// A nested object's members checked against `spec` (QEMU names a member in its
    /// messages as `path.member`).
    pub fn check_nested(
        map: Map<String, Value>,
        spec: &[Arg],
        path: &str,
    ) -> Result<Self, QmpError> {
        check_members(&map, spec, false, &format!("{path}."))?;
        Ok(Self { map })
    }

    /// A nested object's members, unchecked, for an option parser to take.
    pub fn from_map(map: Map<String, Value>) -> Self {
        Self { map }
    }

    /// An argument as given (any type).
    pub fn take(&mut self, name: &str) -> Option<Value> {
        self.map.remove(name)
    }

    /// A string argument.
    pub fn str(&mut self, name: &str) -> Option<String> {
        match self.map.remove(name) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    /// A required string argument (checked present by the schema).
    pub fn str_req(&mut self, name: &str) -> Result<String, QmpError> {
        self.str(name).ok_or_else(|| missing(name))
    }

    /// A boolean argument.
    pub fn bool(&mut self, name: &str) -> Option<bool> {
        self.map.remove(name).and_then(|v| v.as_bool())
    }

    /// An integer argument.
    pub fn i64(&mut self, name: &str) -> Option<i64> {
        self.map.remove(name).and_then(|v| v.as_i64())
    }

    /// An array argument.
    pub fn array(&mut self, name: &str) -> Option<Vec<Value>> {
        match self.map.remove(name) {
            Some(Value::Array(a)) => Some(a),
            _ => None,
        }
    }

    /// Whatever the handler has not taken, for `open` commands.
    pub fn rest(&self) -> &Map<String, Value> {
        &self.map
    }

    /// Sets an argument (a handler reshaping its input for the option parsers).
    pub fn insert(&mut self, name: String, v: Value) {
        self.map.insert(name, v);
    }

    /// The rest as key=value options (nested objects flattened with dots), for the
    /// daemon's option parsers.
    pub fn into_keyval(self, what: &str) -> KeyVal {
        let mut pairs = Vec::new();
        flatten(&mut pairs, "", &self.map);
        KeyVal::from_pairs(what, pairs)
    }
}

/// Checks the members of one object (`path` prefixes the names errors give, as QEMU
/// names nested members: `options.size`); a union member's own members are checked as
/// its tag selects.
fn check_members(
    map: &Map<String, Value>,
    spec: &[Arg],
    open: bool,
    path: &str,
) -> Result<(), QmpError> {
    for a in spec {
        let name = format!("{path}{}", a.name);
        match map.get(a.name).map(|v| (v, a.ty.check(v))) {
            None if a.required => return Err(missing(&name)),
            Some((_, Err(Mismatch::Type(expected)))) => return Err(type_error(&name, expected)),
            Some((_, Err(Mismatch::Value(v)))) => return Err(bad_enum_value(&name, &v)),
            Some((Value::Object(inner), Ok(()))) => match a.ty {
                Ty::Union(u) => check_union(inner, u, &format!("{name}."))?,
                Ty::Struct(members) => check_members(inner, members, false, &format!("{name}."))?,
                _ => {}
            },
            _ => {}
        }
    }
    if !open {
        if let Some(k) = map.keys().find(|k| !spec.iter().any(|a| a.name == *k)) {
            return Err(QmpError::generic(format!(
                "Parameter '{path}{k}' is unexpected"
            )));
        }
    }
    Ok(())
}

/// A union's tag, then the members its value selects (a value without members of its own
/// takes only the tag, as QAPI's unions with an empty branch).
fn check_union(map: &Map<String, Value>, u: &UnionType, path: &str) -> Result<(), QmpError> {
    let tag = req(u.tag, Ty::Enum(u.tag_type));
    check_members(map, &[tag], true, path)?;
    let value = map[u.tag].as_str().unwrap_or_default();
    let mut members = vec![tag];
    members.extend_from_slice(u.variant(value).unwrap_or(&[]));
    check_members(map, &members, false, path)
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
            // Lists become key.0, key.1, ... as QEMU's qdict_flatten makes them.
            Value::Array(items) => {
                let m: Map<String, Value> = items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| (i.to_string(), x.clone()))
                    .collect();
                flatten(out, &key, &m);
            }
            Value::String(s) => out.push((key, s.clone())),
            Value::Bool(b) => out.push((key, if *b { "on" } else { "off" }.into())),
            other => out.push((key, other.to_string())),
        }
    }
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
    (c.run)(state, args)
}

/// `query-qmp-schema`'s answer, generated from [`COMMANDS`] and the events table: QEMU's
/// `SchemaInfo` list, with type names numbered as QEMU masks them. Enums and unions come
/// from the tables behind them (the block drivers); arguments whose structure stord checks
/// itself (driver options, nested addresses) appear as `any`.
pub fn schema() -> Value {
    let mut b = SchemaBuilder::default();
    let qmp_capabilities = Command {
        name: "qmp_capabilities",
        args: &[],
        open: false,
        run: |_, _| Ok(json!({})),
    };
    for c in std::iter::once(&qmp_capabilities).chain(COMMANDS) {
        let arg_type = b.object(c.args);
        b.out.push(json!({
            "name": c.name,
            "meta-type": "command",
            "arg-type": arg_type,
            "ret-type": "any",
        }));
    }
    for e in crate::events::EVENTS {
        let members: Vec<Arg> = e
            .members
            .iter()
            .map(|(name, ty)| Arg {
                // QAPI's mark for an optional member.
                name: name.trim_start_matches('?'),
                ty: match *ty {
                    "str" => Ty::Str,
                    "bool" => Ty::Bool,
                    "int" => Ty::Int,
                    _ => Ty::Any,
                },
                required: !name.starts_with('?'),
            })
            .collect();
        let arg_type = b.object(&members);
        b.out
            .push(json!({ "name": e.name, "meta-type": "event", "arg-type": arg_type }));
    }
    for (name, json_type) in [
        ("str", "string"),
        ("int", "int"),
        ("uint64", "int"),
        ("bool", "boolean"),
        ("any", "value"),
    ] {
        b.out
            .push(json!({ "name": name, "meta-type": "builtin", "json-type": json_type }));
    }
    Value::Array(b.out)
}

/// Builds the schema's list: object types numbered as they come, each enum and union once.
#[derive(Default)]
struct SchemaBuilder {
    out: Vec<Value>,
    next: u32,
    /// Enums and unions already listed, by QAPI name, with their masked names.
    named: std::collections::HashMap<&'static str, String>,
}

impl SchemaBuilder {
    fn fresh(&mut self) -> String {
        self.next += 1;
        (self.next - 1).to_string()
    }

    /// The name a member of type `ty` refers to (listing its type first if new).
    fn ty(&mut self, ty: Ty) -> String {
        let builtin = match ty {
            Ty::Str => "str",
            Ty::Int => "int",
            Ty::Uint => "uint64",
            Ty::Bool => "bool",
            Ty::Object | Ty::Array | Ty::Any => "any",
            Ty::Enum(e) => return self.enumeration(e),
            Ty::Union(u) => return self.union(u),
            Ty::Struct(members) => return self.object(members),
        };
        builtin.to_string()
    }

    fn members(&mut self, members: &[Arg]) -> Vec<Value> {
        members
            .iter()
            .map(|a| {
                let mut m = json!({ "name": a.name, "type": self.ty(a.ty) });
                if !a.required {
                    m["default"] = Value::Null;
                }
                m
            })
            .collect()
    }

    fn object(&mut self, members: &[Arg]) -> String {
        let members = self.members(members);
        let name = self.fresh();
        self.out
            .push(json!({ "name": name, "meta-type": "object", "members": members }));
        name
    }

    fn enumeration(&mut self, e: &'static EnumType) -> String {
        if let Some(n) = self.named.get(e.name) {
            return n.clone();
        }
        let name = self.fresh();
        self.named.insert(e.name, name.clone());
        let values = (e.values)();
        let members: Vec<Value> = values.iter().map(|v| json!({ "name": v })).collect();
        self.out.push(json!({
            "name": name, "meta-type": "enum", "members": members, "values": values,
        }));
        name
    }

    fn union(&mut self, u: &'static UnionType) -> String {
        if let Some(n) = self.named.get(u.name) {
            return n.clone();
        }
        let name = self.fresh();
        self.named.insert(u.name, name.clone());
        let tag = self.members(&[req(u.tag, Ty::Enum(u.tag_type))]);
        let variants: Vec<Value> = (u.variants)()
            .into_iter()
            .map(|(case, members)| json!({ "case": case, "type": self.object(members) }))
            .collect();
        self.out.push(json!({
            "name": name, "meta-type": "object", "members": tag, "tag": u.tag,
            "variants": variants,
        }));
        name
    }
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
