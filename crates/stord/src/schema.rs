//! What a command's arguments, an event's members or a driver's creation options are, in
//! QAPI's terms: a name, a type and whether it is required. The tables that describe
//! themselves with it (QMP's commands, the events, the drivers' `blockdev-create`
//! options) are checked against it by the monitor and listed by `query-qmp-schema`, so
//! it lives below all of them.

use serde_json::Value;

/// A QAPI enum whose values a table knows (the block drivers) or a fixed list.
#[derive(Debug)]
pub struct EnumType {
    /// QAPI's name for it (query-qmp-schema masks it, as QEMU does).
    pub name: &'static str,
    pub values: fn() -> Vec<&'static str>,
}

impl EnumType {
    pub fn contains(&self, v: &str) -> bool {
        (self.values)().contains(&v)
    }
}

/// A QAPI union: an object whose `tag` member (a value of `tag_type`) selects the members
/// the rest of it may have.
#[derive(Debug)]
pub struct UnionType {
    pub name: &'static str,
    pub tag: &'static str,
    pub tag_type: &'static EnumType,
    /// The tag values that have members of their own, and those members.
    pub variants: fn() -> Vec<(&'static str, &'static [Arg])>,
}

impl UnionType {
    /// The members tag value `tag` adds (None: it adds none).
    pub fn variant(&self, tag: &str) -> Option<&'static [Arg]> {
        (self.variants)()
            .into_iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, members)| members)
    }
}

/// An argument's JSON type, named as QAPI's builtins.
#[derive(Debug, Clone, Copy)]
pub enum Ty {
    Str,
    /// Any integer (QAPI's `int`).
    Int,
    /// A non-negative integer (QAPI's `uint32`, `size`, ...).
    Uint,
    Bool,
    Object,
    Array,
    Any,
    /// A string, one of the enum's values.
    Enum(&'static EnumType),
    /// An object, its members as the union's tag selects (the monitor checks those).
    Union(&'static UnionType),
    /// An object with these members (the monitor checks them, as a struct's).
    Struct(&'static [Arg]),
    /// An array of this type (its elements are not checked).
    List(&'static Ty),
}

/// Why a value does not fit its declared type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The wrong JSON type: QEMU's "expected: ..." names this one.
    Type(&'static str),
    /// A string that is no value of the enum.
    Value(String),
}

impl Ty {
    /// Checks `v` against the type.
    pub fn check(self, v: &Value) -> Result<(), Mismatch> {
        let fits = match self {
            Ty::Str => v.is_string(),
            Ty::Int => v.is_i64() || v.is_u64(),
            Ty::Uint => v.is_u64(),
            Ty::Bool => v.is_boolean(),
            Ty::Object | Ty::Union(_) | Ty::Struct(_) => v.is_object(),
            Ty::Array | Ty::List(_) => v.is_array(),
            Ty::Any => true,
            Ty::Enum(e) => {
                let Some(s) = v.as_str() else {
                    return Err(Mismatch::Type("string"));
                };
                if !e.contains(s) {
                    return Err(Mismatch::Value(s.into()));
                }
                true
            }
        };
        if fits {
            Ok(())
        } else {
            Err(Mismatch::Type(self.expected()))
        }
    }

    /// The name "expected: ..." errors use.
    fn expected(self) -> &'static str {
        match self {
            Ty::Str | Ty::Enum(_) => "string",
            Ty::Int | Ty::Uint => "integer",
            Ty::Bool => "boolean",
            Ty::Object | Ty::Union(_) | Ty::Struct(_) => "object",
            Ty::Array | Ty::List(_) => "array",
            Ty::Any => "any",
        }
    }
}

/// One argument of a command (or member of an event, or creation option).
#[derive(Debug, Clone, Copy)]
pub struct Arg {
    pub name: &'static str,
    pub ty: Ty,
    pub required: bool,
}

/// A required argument.
pub const fn req(name: &'static str, ty: Ty) -> Arg {
    Arg {
        name,
        ty,
        required: true,
    }
}

/// An optional argument.
pub const fn opt(name: &'static str, ty: Ty) -> Arg {
    Arg {
        name,
        ty,
        required: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    static COLOURS: EnumType = EnumType {
        name: "Colour",
        values: || vec!["red", "green"],
    };

    #[test]
    fn enums_take_their_values_only() {
        let t = Ty::Enum(&COLOURS);
        assert_eq!(t.check(&json!("red")), Ok(()));
        assert_eq!(t.check(&json!("blue")), Err(Mismatch::Value("blue".into())));
        assert_eq!(t.check(&json!(1)), Err(Mismatch::Type("string")));
        assert_eq!(Ty::Uint.check(&json!(-1)), Err(Mismatch::Type("integer")));
    }
}
