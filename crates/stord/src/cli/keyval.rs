//! QEMU's `key=value,key2=value2` option syntax (as in `--blockdev driver=file,...`).
//!
//! Commas inside a value are written `,,`. The first element may be a bare word that
//! stands for an implied key (`--object iothread,id=io0` means `qom-type=iothread`). A
//! value that starts with `{` is parsed as JSON instead, as qsd also accepts. Every key
//! must be consumed by whoever parses the options; leftovers are reported by name.

use std::collections::BTreeMap;

/// What is wrong with an option list: the cli layer's error. `what` names the list (e.g.
/// "--blockdev"); the texts are qsd's where it has one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    /// Not `key=value` syntax, or not a JSON object.
    #[error("{what}: {detail}")]
    Syntax { what: String, detail: String },
    /// The same key twice.
    #[error("{what}: option '{key}' given twice")]
    Twice { what: String, key: String },
    /// A required key is absent.
    #[error("{what}: Parameter '{key}' is missing")]
    Missing { what: String, key: String },
    /// A value of the wrong kind.
    #[error("{what}: Parameter '{key}' expects {expected}")]
    Value {
        what: String,
        key: String,
        expected: String,
        value: String,
    },
    /// A number outside its stated range.
    #[error("{what}: parameter '{key}' must be in {min}..={max}, got {value}")]
    Range {
        what: String,
        key: String,
        min: u64,
        max: u64,
        value: u64,
    },
    /// A key nobody consumed.
    #[error("{what}: Parameter '{key}' is unexpected")]
    Unknown { what: String, key: String },
}

impl From<OptionError> for String {
    fn from(e: OptionError) -> String {
        e.to_string()
    }
}

/// Parsed options, in the order given; `take_*` consumes them.
#[derive(Debug, Clone, Default)]
pub struct KeyVal {
    /// What the options describe, for error messages (e.g. "--blockdev").
    pub what: String,
    map: BTreeMap<String, String>,
}

impl KeyVal {
    /// Parses `s`; `implied` names the key of a leading bare word, if allowed.
    pub fn parse(what: &str, s: &str, implied: Option<&str>) -> Result<Self, OptionError> {
        let syntax = |detail: String| OptionError::Syntax {
            what: what.to_string(),
            detail,
        };
        let mut kv = KeyVal {
            what: what.to_string(),
            map: BTreeMap::new(),
        };
        if s.trim_start().starts_with('{') {
            let v: serde_json::Value =
                serde_json::from_str(s).map_err(|e| syntax(format!("invalid JSON: {e}")))?;
            let obj = v
                .as_object()
                .ok_or_else(|| syntax("expected a JSON object".into()))?;
            flatten_json(&mut kv.map, "", obj);
            return Ok(kv);
        }
        let mut items = Vec::new();
        let mut cur = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c == ',' {
                if chars.peek() == Some(&',') {
                    chars.next();
                    cur.push(',');
                } else {
                    items.push(std::mem::take(&mut cur));
                }
            } else {
                cur.push(c);
            }
        }
        items.push(cur);
        for (i, item) in items.into_iter().enumerate() {
            if item.is_empty() {
                continue;
            }
            let (k, v) = match (item.split_once('='), implied) {
                (Some((k, v)), _) => (k.to_string(), v.to_string()),
                (None, Some(key)) if i == 0 => (key.to_string(), item.clone()),
                (None, _) => return Err(syntax(format!("expected key=value, got '{item}'"))),
            };
            if k.is_empty() {
                return Err(syntax(format!("empty key in '{item}'")));
            }
            if kv.map.insert(k.clone(), v).is_some() {
                return Err(OptionError::Twice {
                    what: what.to_string(),
                    key: k,
                });
            }
        }
        Ok(kv)
    }

    /// Builds options from already split pairs (used for QMP-like input).
    pub fn from_pairs(what: &str, pairs: impl IntoIterator<Item = (String, String)>) -> Self {
        KeyVal {
            what: what.to_string(),
            map: pairs.into_iter().collect(),
        }
    }

    /// A string option, left in place.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.map.get(key).map(String::as_str)
    }

    /// Sets `key` to `value` unless it is given (an option a child inherits from its
    /// parent, as QEMU's inline children do).
    pub fn inherit(&mut self, key: &str, value: &str) {
        self.map
            .entry(key.to_string())
            .or_insert_with(|| value.to_string());
    }

    /// Sets `key` (replacing what it was).
    pub fn insert(&mut self, key: &str, value: String) {
        self.map.insert(key.to_string(), value);
    }

    /// The error for a required `key` that is absent.
    pub fn missing(&self, key: &str) -> OptionError {
        OptionError::Missing {
            what: self.what.clone(),
            key: key.to_string(),
        }
    }

    /// Removes and returns a string option.
    pub fn take(&mut self, key: &str) -> Option<String> {
        self.map.remove(key)
    }

    /// The error for `key`'s `value`, which is not `expected`.
    pub fn bad_value(&self, key: &str, expected: &str, value: &str) -> OptionError {
        OptionError::Value {
            what: self.what.clone(),
            key: key.to_string(),
            expected: expected.to_string(),
            value: value.to_string(),
        }
    }

    /// A required string option.
    pub fn take_required(&mut self, key: &str) -> Result<String, OptionError> {
        self.take(key).ok_or_else(|| OptionError::Missing {
            what: self.what.clone(),
            key: key.to_string(),
        })
    }

    /// An `on|off` option (also `true|false|yes|no`).
    pub fn take_bool(&mut self, key: &str, default: bool) -> Result<bool, OptionError> {
        match self.take(key).as_deref() {
            None => Ok(default),
            Some("on" | "true" | "yes") => Ok(true),
            Some("off" | "false" | "no") => Ok(false),
            Some(v) => Err(self.bad_value(key, "'on' or 'off'", v)),
        }
    }

    /// A number, with QEMU's size suffixes (k, M, G, T, in powers of 1024) when `size`.
    pub fn take_u64(&mut self, key: &str, size: bool) -> Result<Option<u64>, OptionError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        parse_u64(&v, size).map(Some).ok_or_else(|| {
            let kind = if size {
                "a size (e.g. 1G, 512M, 4096)"
            } else {
                "a non-negative integer"
            };
            self.bad_value(key, kind, &v)
        })
    }

    /// A number in `range` (the range goes into the error).
    pub fn take_u64_in(
        &mut self,
        key: &str,
        size: bool,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<Option<u64>, OptionError> {
        match self.take_u64(key, size)? {
            Some(v) if !range.contains(&v) => Err(OptionError::Range {
                what: self.what.clone(),
                key: key.to_string(),
                min: *range.start(),
                max: *range.end(),
                value: v,
            }),
            v => Ok(v),
        }
    }

    /// An option whose value is one of `allowed`.
    pub fn take_choice(
        &mut self,
        key: &str,
        allowed: &[&str],
    ) -> Result<Option<String>, OptionError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) if allowed.contains(&v.as_str()) => Ok(Some(v)),
            Some(v) => Err(self.bad_value(key, &format!("one of {}", allowed.join(", ")), &v)),
        }
    }

    /// A list option: `key=a`, or `key.0=a,key.1=b` (JSON: `"key": ["a", "b"]`).
    pub fn take_list(&mut self, key: &str) -> Vec<String> {
        let mut list: Vec<String> = self.take(key).into_iter().collect();
        while let Some(v) = self.take(&format!("{key}.{}", list.len())) {
            list.push(v);
        }
        list
    }

    /// Removes every `prefix.key` option and returns them as options of their own
    /// (`file.driver=file,file.filename=x` gives `driver=file,filename=x`): an inline
    /// child's options. None if there are none.
    pub fn take_prefixed(&mut self, prefix: &str) -> Option<KeyVal> {
        let dotted = format!("{prefix}.");
        let keys: Vec<String> = self
            .map
            .keys()
            .filter(|k| k.starts_with(&dotted))
            .cloned()
            .collect();
        if keys.is_empty() {
            return None;
        }
        let map = keys
            .into_iter()
            .map(|k| {
                let v = self.map.remove(&k).expect("listed");
                (k[dotted.len()..].to_string(), v)
            })
            .collect();
        Some(KeyVal {
            what: format!("{} ({prefix})", self.what),
            map,
        })
    }

    /// A nested object's members (`location.pool=p` gives `pool=p`), named `what.prefix`
    /// in errors as QMP names nested members. None if there are none.
    pub fn take_object(&mut self, prefix: &str) -> Option<KeyVal> {
        let mut kv = self.take_prefixed(prefix)?;
        kv.what = format!("{}.{prefix}", self.what);
        Some(kv)
    }

    /// Fails naming the first option nobody consumed.
    pub fn finish(self) -> Result<(), OptionError> {
        match self.map.into_keys().next() {
            None => Ok(()),
            Some(key) => Err(OptionError::Unknown {
                what: self.what,
                key,
            }),
        }
    }
}

fn flatten_json(
    out: &mut BTreeMap<String, String>,
    prefix: &str,
    obj: &serde_json::Map<String, serde_json::Value>,
) {
    for (k, v) in obj {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            serde_json::Value::Object(o) => flatten_json(out, &key, o),
            serde_json::Value::String(s) => {
                out.insert(key, s.clone());
            }
            serde_json::Value::Bool(b) => {
                out.insert(key, if *b { "on" } else { "off" }.to_string());
            }
            other => {
                out.insert(key, other.to_string());
            }
        }
    }
}

/// Fuzz entry (`fuzz/fuzz_targets/keyval.rs`): `data` as an option list with an implied
/// key, then consumed the ways the daemon consumes options.
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub fn fuzz(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mut kv) = KeyVal::parse("--fuzz", s, Some("driver")) else {
        return;
    };
    let _ = kv.take_bool("read-only", false);
    let _ = kv.take_u64("size", true);
    let _ = kv.take_u64("poll-max-ns", false);
    let _ = kv.take_choice("aio", &["io_uring", "native", "threads"]);
    let _ = kv.take_list("iothread");
    if let Some(child) = kv.take_prefixed("file") {
        let _ = child.finish();
    }
    let _ = kv.take_required("driver");
    let _ = kv.finish();
}

/// Parses a number; with `size`, accepts k/M/G/T/P/E suffixes (powers of 1024).
pub fn parse_u64(v: &str, size: bool) -> Option<u64> {
    let v = v.trim();
    if let Ok(n) = v.parse::<u64>() {
        return Some(n);
    }
    if !size || v.is_empty() {
        return None;
    }
    // The suffix is one character, which need not be one byte ("1é" must not panic).
    let mut chars = v.chars();
    let suffix = chars.next_back()?.to_string();
    let num = chars.as_str();
    let shift = match suffix.as_str() {
        "k" | "K" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        "T" | "t" => 40,
        "P" | "p" => 50,
        "E" | "e" => 60,
        _ => return None,
    };
    let n: u64 = num.parse().ok()?;
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_outside_their_range_name_it() {
        let mut kv = KeyVal::parse("--nbd-server", "max-connections=4294967296,n=3", None).unwrap();
        let e = kv
            .take_u64_in("max-connections", false, 0..=u64::from(u32::MAX))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--nbd-server: parameter 'max-connections' must be in 0..=4294967295, got 4294967296"
        );
        assert_eq!(kv.take_u64_in("n", false, 1..=64).unwrap(), Some(3));
        assert_eq!(kv.take_u64_in("absent", false, 1..=64).unwrap(), None);
    }

    /// Found by the keyval fuzz target: a multi-byte last character panicked in split_at.
    #[test]
    fn sizes_with_a_multibyte_suffix_are_errors_not_panics() {
        assert_eq!(parse_u64("0\u{a6}", true), None);
        assert_eq!(parse_u64("\u{e9}", true), None);
        assert_eq!(parse_u64("4k", true), Some(4096));
        let mut kv = KeyVal::parse("--blockdev", "driver=null-co,size=1\u{e9}", None).unwrap();
        assert!(kv.take_u64("size", true).is_err());
    }

    #[test]
    fn list_options_take_one_value_or_an_indexed_list() {
        let mut kv = KeyVal::parse("--export", "iothread=a", None).unwrap();
        assert_eq!(kv.take_list("iothread"), vec!["a"]);
        let mut kv =
            KeyVal::parse("--export", "iothread.0=a,iothread.1=b,iothread.3=d", None).unwrap();
        assert_eq!(kv.take_list("iothread"), vec!["a", "b"]);
        // A gap ends the list; what follows is left for finish() to report.
        assert!(kv.finish().is_err());
    }

    #[test]
    fn parses_qemu_keyval() {
        let mut kv = KeyVal::parse(
            "--object",
            "iothread,id=io0,poll-max-ns=1000",
            Some("qom-type"),
        )
        .unwrap();
        assert_eq!(kv.take("qom-type").as_deref(), Some("iothread"));
        assert_eq!(kv.take_u64("poll-max-ns", false).unwrap(), Some(1000));
        assert_eq!(kv.take("id").as_deref(), Some("io0"));
        kv.finish().unwrap();
    }

    #[test]
    fn double_comma_escapes_and_errors_name_the_option() {
        let mut kv = KeyVal::parse(
            "--blockdev",
            "driver=file,filename=a,,b.img,cache.direct=maybe",
            None,
        )
        .unwrap();
        assert_eq!(kv.take("filename").as_deref(), Some("a,b.img"));
        let e = kv.take_bool("cache.direct", false).unwrap_err();
        assert!(
            matches!(&e, OptionError::Value { key, value, .. } if key == "cache.direct" && value == "maybe"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "--blockdev: Parameter 'cache.direct' expects 'on' or 'off'"
        );
        let e = kv.finish().unwrap_err();
        assert!(
            matches!(&e, OptionError::Unknown { key, .. } if key == "driver"),
            "{e:?}"
        );
        let e = KeyVal::parse("--export", "type=nbd,oops", None).unwrap_err();
        assert!(matches!(&e, OptionError::Syntax { .. }) && e.to_string().contains("oops"));
        let e = KeyVal::parse("--export", "a=1,a=2", None).unwrap_err();
        assert!(
            matches!(&e, OptionError::Twice { key, .. } if key == "a"),
            "{e:?}"
        );
    }

    #[test]
    fn sizes_and_json() {
        assert_eq!(parse_u64("1G", true), Some(1 << 30));
        assert_eq!(parse_u64("512k", true), Some(512 << 10));
        assert_eq!(parse_u64("1G", false), None);
        let mut kv = KeyVal::parse(
            "--blockdev",
            r#"{"driver":"file","cache":{"direct":true},"size":4096}"#,
            None,
        )
        .unwrap();
        assert!(kv.take_bool("cache.direct", false).unwrap());
        assert_eq!(kv.take_u64("size", true).unwrap(), Some(4096));
    }

    #[test]
    fn an_inline_child_is_taken_by_its_prefix() {
        let mut kv = KeyVal::parse(
            "--blockdev",
            "driver=raw,node-name=r,file.driver=file,file.filename=x,file.cache.direct=on,filex=1",
            None,
        )
        .unwrap();
        let mut child = kv.take_prefixed("file").unwrap();
        assert_eq!(child.take("driver").as_deref(), Some("file"));
        assert_eq!(child.take("filename").as_deref(), Some("x"));
        assert!(child.take_bool("cache.direct", false).unwrap());
        child.finish().unwrap();
        assert!(kv.take_prefixed("file").is_none());
        assert_eq!(kv.take("filex").as_deref(), Some("1"));
    }
}
