//! QMP text as QEMU writes it, byte for byte: its JSON writer's separators (`", "` and
//! `": "`), its string escapes (everything outside printable ASCII as `\uXXXX`, upper-case
//! hex, surrogate pairs beyond the BMP) and its key order. QEMU keeps an object's members
//! in a hash table of 512 buckets (qobject/qdict.c) and writes them bucket by bucket, the
//! latest inserted first within a bucket; so members are ordered here by QEMU's hash of
//! their name, then by reverse insertion order (serde_json keeps insertion order). Tests,
//! transcripts and scripts that compare text see what qsd would have sent.

use serde_json::{Map, Value};

/// QEMU's `QDICT_BUCKET_MAX`.
const BUCKETS: u32 = 512;

/// QEMU's `tdb_hash` (from gdbm via tdb) of a member name.
fn tdb_hash(name: &str) -> u32 {
    let mut value = 0x238F_13AFu32.wrapping_mul(name.len() as u32);
    for (i, b) in name.bytes().enumerate() {
        value = value.wrapping_add(u32::from(b).wrapping_shl((i * 5 % 24) as u32));
    }
    1_103_515_243u32.wrapping_mul(value).wrapping_add(12345)
}

/// The bucket QEMU puts member `name` in.
fn bucket(name: &str) -> u32 {
    tdb_hash(name) % BUCKETS
}

/// `v` as one line of QMP text (without the line end).
pub fn to_text(v: &Value) -> String {
    let mut out = String::new();
    write(&mut out, v);
    out
}

/// `v` as a monitor with `pretty=on` sends it (QEMU's JSON writer, pretty): every member
/// and element on a line of its own, indented four spaces a level, a container's closing
/// bracket on a line of its own (an empty one too). Without the final line end.
pub fn to_pretty_text(v: &Value) -> String {
    let mut out = String::new();
    write_pretty(&mut out, v, 0);
    out
}

fn write_pretty(out: &mut String, v: &Value, depth: usize) {
    let newline = |out: &mut String, d: usize| {
        out.push('\n');
        out.push_str(&"    ".repeat(d));
    };
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                write_pretty(out, item, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (n, (k, v)) in in_qemu_order(m).into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                quoted(out, k);
                out.push_str(": ");
                write_pretty(out, v, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
        scalar => write(out, scalar),
    }
}

/// An object's members in the order QEMU writes them.
fn in_qemu_order(m: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut members: Vec<(usize, &String, &Value)> =
        m.iter().enumerate().map(|(i, (k, v))| (i, k, v)).collect();
    // Bucket order, and the latest inserted first within a bucket.
    members.sort_by_key(|(i, k, _)| (bucket(k), std::cmp::Reverse(*i)));
    members.into_iter().map(|(_, k, v)| (k, v)).collect()
}

fn write(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => quoted(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write(out, item);
            }
            out.push(']');
        }
        Value::Object(m) => object(out, m),
    }
}

fn object(out: &mut String, m: &Map<String, Value>) {
    out.push('{');
    for (n, (k, v)) in in_qemu_order(m).into_iter().enumerate() {
        if n > 0 {
            out.push_str(", ");
        }
        quoted(out, k);
        out.push_str(": ");
        write(out, v);
    }
    out.push('}');
}

/// A string as QEMU's `quoted_str` writes it.
fn quoted(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What qemu-storage-daemon 10.0 sent for the same values (its greeting, a query and
    /// an error), as read off its monitor.
    #[test]
    fn qemus_separators_and_member_order() {
        let version = json!({
            "qemu": { "major": 10, "minor": 0, "micro": 2 },
            "package": "Debian 1:10.0.2+ds-2+deb13u1~bpo12+1",
        });
        let greeting = json!({ "QMP": { "version": version.clone(), "capabilities": ["oob"] } });
        assert_eq!(
            to_text(&greeting),
            r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian 1:10.0.2+ds-2+deb13u1~bpo12+1"}, "capabilities": ["oob"]}}"#
        );
        assert_eq!(
            to_text(&json!({ "return": version, "id": 1 })),
            r#"{"return": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian 1:10.0.2+ds-2+deb13u1~bpo12+1"}, "id": 1}"#
        );
        assert_eq!(to_text(&json!({ "return": {} })), r#"{"return": {}}"#);
        let e = json!({ "error": { "class": "CommandNotFound", "desc": "The command nope has not been found" } });
        assert_eq!(
            to_text(&e),
            r#"{"error": {"class": "CommandNotFound", "desc": "The command nope has not been found"}}"#
        );
        let ev = json!({
            "event": "JOB_STATUS_CHANGE",
            "data": { "status": "created", "id": "j" },
            "timestamp": { "seconds": 1, "microseconds": 2 },
        });
        assert_eq!(
            to_text(&ev),
            r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "JOB_STATUS_CHANGE", "data": {"status": "created", "id": "j"}}"#
        );
    }

    /// QEMU's pretty form: iotest 184's `"children": [` with its `]` on a line of its
    /// own, qsd's `{"return": {}}` over a `pretty=on` monitor.
    #[test]
    fn pretty_text_as_qemus_json_writer_writes_it() {
        assert_eq!(
            to_pretty_text(&json!({ "return": {} })),
            "{\n    \"return\": {\n    }\n}"
        );
        assert_eq!(
            to_pretty_text(&json!({ "return": [1, {"a": []}], "id": 7 })),
            "{\n    \"return\": [\n        1,\n        {\n            \"a\": [\n            ]\n        }\n    ],\n    \"id\": 7\n}"
        );
        assert_eq!(to_pretty_text(&json!("x")), "\"x\"");
    }

    #[test]
    fn strings_are_escaped_as_qemu_escapes_them() {
        assert_eq!(to_text(&json!("a\"b\\c\n\t")), r#""a\"b\\c\n\t""#);
        assert_eq!(to_text(&json!("\u{1}é😀")), r#""\u0001\u00E9\uD83D\uDE00""#);
        assert_eq!(to_text(&json!([1, null, true])), "[1, null, true]");
    }
}
