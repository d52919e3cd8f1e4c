//! The `iothread` object's properties, described once.
//!
//! QEMU's event-loop properties (`poll-max-ns`, `poll-grow`, `poll-shrink`, `poll-weight`,
//! `aio-max-batch`) and ours (`poll-policy`, `poll-grow-start`, `poll-allow-shrink`,
//! `poll-yield-ns`, `reactor`, `sched-slice-ns`) are read from `--object iothread,...` and
//! `object-add`, changed by `qom-set`, read by `qom-get` and shown by `query-iothreads`:
//! every one of those goes through [`PROPERTIES`], so a new property is one entry.

use serde_json::Value;
use stord_aio::{PollParams, ReactorKind, DEFAULT_SCHED_SLICE_NS};

use crate::cli::keyval::{KeyVal, OptionError};

/// A property's JSON (and option) type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Int,
    Bool,
    Str,
}

impl Kind {
    /// As QEMU names it in "expected: ..." errors.
    pub fn expected(self) -> &'static str {
        match self {
            Kind::Int => "integer",
            Kind::Bool => "boolean",
            Kind::Str => "string",
        }
    }

    /// Whether `v` has this type.
    pub fn matches(self, v: &Value) -> bool {
        match self {
            Kind::Int => v.is_u64(),
            Kind::Bool => v.is_boolean(),
            Kind::Str => v.is_string(),
        }
    }
}

/// One value, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PropValue {
    Int(u64),
    Bool(bool),
    Str(String),
}

impl PropValue {
    fn int(&self) -> u64 {
        match self {
            PropValue::Int(v) => *v,
            _ => 0,
        }
    }
}

/// What an iothread is made with.
#[derive(Debug, Clone)]
pub struct IoThreadConfig {
    pub poll: PollParams,
    pub reactor: ReactorKind,
    /// The scheduler slice its thread asks for (0: the kernel's default).
    pub sched_slice_ns: u64,
}

impl Default for IoThreadConfig {
    fn default() -> Self {
        Self {
            poll: PollParams::default(),
            reactor: ReactorKind::Auto,
            sched_slice_ns: DEFAULT_SCHED_SLICE_NS,
        }
    }
}

/// The slices the kernel takes (it clamps others to these bounds; stord refuses them).
const SCHED_SLICE_NS: std::ops::RangeInclusive<u64> = 100_000..=100_000_000;

/// One property.
pub struct Property {
    pub name: &'static str,
    pub kind: Kind,
    /// A field of QEMU's `IOThreadInfo` (query-iothreads shows it).
    pub in_query: bool,
    /// `qom-set` may change it on a running thread.
    pub live: bool,
    pub get: fn(&IoThreadConfig) -> Value,
    pub set: fn(&mut IoThreadConfig, &PropValue) -> Result<(), String>,
}

fn ignored(_: &mut IoThreadConfig, _: &PropValue) -> Result<(), String> {
    Ok(())
}

/// Every iothread property, in query-iothreads' order.
pub const PROPERTIES: &[Property] = &[
    Property {
        name: "poll-max-ns",
        kind: Kind::Int,
        in_query: true,
        live: true,
        get: |c| c.poll.max_ns.into(),
        set: |c, v| {
            c.poll.max_ns = v.int();
            Ok(())
        },
    },
    Property {
        name: "poll-grow",
        kind: Kind::Int,
        in_query: true,
        live: true,
        get: |c| c.poll.grow.into(),
        set: |c, v| {
            c.poll.grow = v.int();
            Ok(())
        },
    },
    Property {
        name: "poll-shrink",
        kind: Kind::Int,
        in_query: true,
        live: true,
        get: |c| c.poll.shrink.into(),
        set: |c, v| {
            c.poll.shrink = v.int();
            Ok(())
        },
    },
    Property {
        name: "poll-weight",
        kind: Kind::Int,
        in_query: true,
        live: true,
        get: |c| c.poll.weight.into(),
        set: |c, v| {
            c.poll.weight = u32::try_from(v.int())
                .map_err(|_| format!("poll-weight must be in 0..=63, got {}", v.int()))?;
            Ok(())
        },
    },
    // QEMU's batch size for Linux AIO submissions: accepted, stord's file engines batch
    // by themselves.
    Property {
        name: "aio-max-batch",
        kind: Kind::Int,
        in_query: true,
        live: true,
        get: |_| 0.into(),
        set: ignored,
    },
    Property {
        name: "poll-policy",
        kind: Kind::Str,
        in_query: true,
        live: true,
        get: |c| c.poll.policy.name().into(),
        set: |c, v| {
            let PropValue::Str(s) = v else { return Ok(()) };
            c.poll.policy = s.parse()?;
            Ok(())
        },
    },
    Property {
        name: "poll-grow-start",
        kind: Kind::Int,
        in_query: false,
        live: true,
        get: |c| c.poll.grow_start_ns.into(),
        set: |c, v| {
            c.poll.grow_start_ns = v.int();
            Ok(())
        },
    },
    Property {
        name: "poll-allow-shrink",
        kind: Kind::Bool,
        in_query: false,
        live: true,
        get: |c| c.poll.allow_shrink.into(),
        set: |c, v| {
            c.poll.allow_shrink = *v == PropValue::Bool(true);
            Ok(())
        },
    },
    Property {
        name: "poll-yield-ns",
        kind: Kind::Int,
        in_query: false,
        live: true,
        get: |c| c.poll.yield_ns.into(),
        set: |c, v| {
            c.poll.yield_ns = v.int();
            Ok(())
        },
    },
    Property {
        name: "reactor",
        kind: Kind::Str,
        in_query: false,
        live: false,
        get: |c| c.reactor.name().into(),
        set: |c, v| {
            let PropValue::Str(s) = v else { return Ok(()) };
            c.reactor = s.parse()?;
            Ok(())
        },
    },
    Property {
        name: "sched-slice-ns",
        kind: Kind::Int,
        in_query: false,
        live: false,
        get: |c| c.sched_slice_ns.into(),
        set: |c, v| {
            let ns = v.int();
            if ns != 0 && !SCHED_SLICE_NS.contains(&ns) {
                return Err(format!(
                    "sched-slice-ns must be 0 or in {}..={}, got {ns}",
                    SCHED_SLICE_NS.start(),
                    SCHED_SLICE_NS.end()
                ));
            }
            c.sched_slice_ns = ns;
            Ok(())
        },
    },
    // QEMU's thread pool bounds: stord's file engines need no thread pool.
    Property {
        name: "thread-pool-min",
        kind: Kind::Int,
        in_query: false,
        live: false,
        get: |_| 0.into(),
        set: ignored,
    },
    Property {
        name: "thread-pool-max",
        kind: Kind::Int,
        in_query: false,
        live: false,
        get: |_| 0.into(),
        set: ignored,
    },
];

/// The property `name`.
pub fn property(name: &str) -> Option<&'static Property> {
    PROPERTIES.iter().find(|p| p.name == name)
}

/// Why a property could not be read or set.
#[derive(Debug, thiserror::Error)]
pub enum PropertyError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("Property 'iothread.{0}' not found")]
    NotFound(String),
    #[error("Invalid parameter type for '{name}', expected: {expected}")]
    Type {
        name: String,
        expected: &'static str,
    },
    #[error("{0}")]
    Range(String),
}

/// The configuration `--object iothread,...` / `object-add` describe (`qom-type` and `id`
/// already taken): every property the table knows, checked against its range.
pub fn from_options(kv: &mut KeyVal) -> Result<IoThreadConfig, PropertyError> {
    let mut c = IoThreadConfig::default();
    for p in PROPERTIES {
        let v = match p.kind {
            Kind::Int => kv.take_u64(p.name, false)?.map(PropValue::Int),
            Kind::Bool if kv.get(p.name).is_some() => {
                Some(PropValue::Bool(kv.take_bool(p.name, false)?))
            }
            Kind::Bool => None,
            Kind::Str => kv.take(p.name).map(PropValue::Str),
        };
        if let Some(v) = v {
            (p.set)(&mut c, &v).map_err(|e| PropertyError::Range(format!("{}: {e}", kv.what)))?;
        }
    }
    c.poll
        .validate()
        .map_err(|e| PropertyError::Range(format!("{}: {e}", kv.what)))?;
    Ok(c)
}

/// Checks the JSON types of the properties an `object-add` of an iothread carries (QEMU's
/// visitor checks them before anything else).
pub fn check_json_types(args: &serde_json::Map<String, Value>) -> Result<(), PropertyError> {
    for p in PROPERTIES {
        if let Some(v) = args.get(p.name) {
            if !p.kind.matches(v) {
                return Err(PropertyError::Type {
                    name: p.name.into(),
                    expected: p.kind.expected(),
                });
            }
        }
    }
    Ok(())
}

/// `qom-get` of a property of a thread configured as `c`.
pub fn get(c: &IoThreadConfig, name: &str) -> Result<Value, PropertyError> {
    if name == "type" {
        return Ok("iothread".into());
    }
    let p = property(name).ok_or_else(|| PropertyError::NotFound(name.into()))?;
    Ok((p.get)(c))
}

/// `qom-set`: the new configuration, checked whole.
pub fn set(c: &mut IoThreadConfig, name: &str, value: &Value) -> Result<(), PropertyError> {
    let p = property(name)
        .filter(|p| p.live)
        .ok_or_else(|| PropertyError::NotFound(name.into()))?;
    let v = match p.kind {
        Kind::Int => value.as_u64().map(PropValue::Int),
        Kind::Bool => value.as_bool().map(PropValue::Bool),
        Kind::Str => value.as_str().map(|s| PropValue::Str(s.into())),
    }
    .ok_or_else(|| PropertyError::Type {
        name: name.into(),
        expected: p.kind.expected(),
    })?;
    (p.set)(c, &v).map_err(PropertyError::Range)?;
    c.poll.validate().map_err(PropertyError::Range)
}

/// The fields `query-iothreads` shows of a thread configured as `c`.
pub fn query_fields(c: &IoThreadConfig, out: &mut serde_json::Map<String, Value>) {
    for p in PROPERTIES.iter().filter(|p| p.in_query) {
        out.insert(p.name.into(), (p.get)(c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_qom_and_query_share_one_table() {
        let mut kv = KeyVal::parse(
            "--object",
            "poll-max-ns=1000,poll-weight=2,poll-policy=weighted,poll-allow-shrink=off,reactor=epoll,aio-max-batch=4",
            None,
        )
        .unwrap();
        let mut c = from_options(&mut kv).unwrap();
        kv.finish().unwrap();
        assert_eq!(c.poll.max_ns, 1000);
        assert!(!c.poll.allow_shrink);
        assert_eq!(get(&c, "poll-policy").unwrap(), "weighted");
        assert_eq!(get(&c, "reactor").unwrap(), "epoll");
        set(&mut c, "poll-grow", &Value::from(4)).unwrap();
        assert_eq!(c.poll.grow, 4);
        let e = set(&mut c, "poll-grow", &Value::from(1u64 << 40)).unwrap_err();
        assert!(e.to_string().contains("0..=1024"), "{e}");
        assert!(matches!(
            set(&mut c, "reactor", &Value::from("io_uring")),
            Err(PropertyError::NotFound(_))
        ));
        assert!(matches!(
            set(&mut c, "poll-weight", &Value::from("x")),
            Err(PropertyError::Type { .. })
        ));
        let mut m = serde_json::Map::new();
        query_fields(&c, &mut m);
        let keys: Vec<&str> = m.keys().map(String::as_str).collect();
        for k in [
            "poll-max-ns",
            "poll-grow",
            "poll-shrink",
            "poll-weight",
            "aio-max-batch",
        ] {
            assert!(keys.contains(&k), "{keys:?}");
        }
        assert!(!keys.contains(&"reactor"));
        assert!(!keys.contains(&"sched-slice-ns"));
    }

    #[test]
    fn the_scheduler_slice_is_short_by_default_and_kept_in_the_kernels_bounds() {
        let parse = |opts: &str| {
            let mut kv = KeyVal::parse("--object", opts, None).unwrap();
            from_options(&mut kv)
        };
        let c = parse("poll-max-ns=0").unwrap();
        assert_eq!(get(&c, "sched-slice-ns").unwrap(), DEFAULT_SCHED_SLICE_NS);
        assert_eq!(parse("sched-slice-ns=0").unwrap().sched_slice_ns, 0);
        assert_eq!(
            parse("sched-slice-ns=100000000").unwrap().sched_slice_ns,
            100_000_000
        );
        let mut c = parse("sched-slice-ns=200000").unwrap();
        // Fixed when the thread starts, as `reactor` is.
        assert!(matches!(
            set(&mut c, "sched-slice-ns", &Value::from(300_000)),
            Err(PropertyError::NotFound(_))
        ));
        assert_eq!(c.sched_slice_ns, 200_000);
        for bad in ["sched-slice-ns=99999", "sched-slice-ns=100000001"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("must be 0 or in 100000..=100000000"), "{e}");
        }
    }
}
