//! `query-qmp-schema`'s answer built from a command table: QEMU's SchemaInfo list, each
//! command's arguments as an object type, the events' members, and the enums and unions
//! behind the arguments, their type names numbered as QEMU masks them.

use serde_json::{json, Value};

use super::command::Command;
use crate::schema::{req, Arg, EnumType, Ty, UnionType};

/// `query-qmp-schema`'s answer, generated from `commands` and the events table: QEMU's
/// `SchemaInfo` list, with type names numbered as QEMU masks them. Enums and unions come
/// from the tables behind them (the block drivers); arguments whose structure stord checks
/// itself (driver options, nested addresses) appear as `any`.
pub fn schema(commands: &[Command]) -> Value {
    let mut b = SchemaBuilder::default();
    let qmp_capabilities = Command {
        name: "qmp_capabilities",
        args: &[],
        open: false,
        ret: Ty::Any,
        run: |_, _| Ok(json!({})),
    };
    for c in std::iter::once(&qmp_capabilities).chain(commands) {
        let arg_type = b.object(c.args);
        let ret_type = b.ty(c.ret);
        b.out.push(json!({
            "name": c.name,
            "meta-type": "command",
            "arg-type": arg_type,
            "ret-type": ret_type,
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
            Ty::List(element) => return self.list(*element),
        };
        builtin.to_string()
    }

    /// An array type, named as QEMU names them: its element's name in brackets.
    fn list(&mut self, element: Ty) -> String {
        let element = self.ty(element);
        let name = format!("[{element}]");
        if !self.out.iter().any(|t| t["name"] == name.as_str()) {
            self.out
                .push(json!({ "name": name, "meta-type": "array", "element-type": element }));
        }
        name
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
