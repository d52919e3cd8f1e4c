//! What a QMP command is (a name, its argument schema, a handler) and the arguments a
//! handler gets: checked against the schema first, with QEMU's messages for a missing,
//! unexpected or mistyped argument, then taken with typed getters. Every handler module
//! builds on this; the table of them is the folder's `mod.rs`.

use serde_json::{Map, Value};

use crate::cli::keyval::KeyVal;
use crate::daemon::SharedState;
use crate::qmp::QmpError;
use crate::schema::{req, Arg, Mismatch, Ty, UnionType};

/// A command's handler: its checked arguments in, a return value or an error out.
pub type Handler = fn(&SharedState, Args) -> Result<Value, QmpError>;

/// One QMP command.
pub struct Command {
    pub name: &'static str,
    pub args: &'static [Arg],
    /// Takes arguments beyond `args` (a driver's, an object type's or an export type's
    /// options, checked by the daemon when it builds the thing).
    pub open: bool,
    /// What it returns, for `query-qmp-schema` (`Any`: not described).
    pub ret: Ty,
    pub run: Handler,
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
    pub(super) fn check(
        map: Map<String, Value>,
        spec: &[Arg],
        open: bool,
    ) -> Result<Self, QmpError> {
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
