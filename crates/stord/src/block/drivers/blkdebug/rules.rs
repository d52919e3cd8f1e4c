//! blkdebug's rules and state machine, as QEMU's block/blkdebug.c keeps them.
//!
//! The state starts at 1. An event first checks its `inject-error` rules against the
//! state (a rule's state 0 matches any): when at least one matches, those become the
//! active rules (replacing the ones armed before); none matching leaves them armed. Then
//! the first matching `set-state` rule sets the next state, taken only after all of the
//! event's rules were looked at. A request that reaches the node takes the first active
//! rule of its kind (and sector, if the rule names one): an errno fails it, errno 0 lets
//! it through unchecked; a `once` rule is deleted when it fires. Events never fail
//! anything themselves: the requests after them do.

use std::io;

use crate::block::node::debug_event::DebugEvent;
use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;

/// The kinds of request a rule may fail (QAPI's BlkdebugIOType), as bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoType {
    Read = 1,
    Write = 2,
    WriteZeroes = 4,
    Discard = 8,
    Flush = 16,
    BlockStatus = 32,
}

impl IoType {
    const NAMES: &'static [(IoType, &'static str)] = &[
        (IoType::Read, "read"),
        (IoType::Write, "write"),
        (IoType::WriteZeroes, "write-zeroes"),
        (IoType::Discard, "discard"),
        (IoType::Flush, "flush"),
        (IoType::BlockStatus, "block-status"),
    ];

    fn from_name(n: &str) -> Option<IoType> {
        Self::NAMES.iter().find(|t| t.1 == n).map(|t| t.0)
    }

    /// QAPI's names, for the schema.
    pub fn names() -> Vec<&'static str> {
        Self::NAMES.iter().map(|t| t.1).collect()
    }
}

/// Every kind but block status: what a rule fails unless it names one.
const DEFAULT_IOTYPES: u8 = 0x1f;

/// An `inject-error` rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectRule {
    pub event: DebugEvent,
    /// 0: any state.
    pub state: u32,
    pub iotypes: u8,
    /// 0: the request goes through.
    pub errno: i32,
    /// In 512-byte sectors.
    pub sector: Option<u64>,
    pub once: bool,
    /// Fail at once rather than after a yield to the loop.
    pub immediately: bool,
    /// QEMU 11.1's `delay-ns`: the request completes (or fails) this much later.
    pub delay_ns: u64,
}

/// A `set-state` rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetStateRule {
    pub event: DebugEvent,
    pub state: u32,
    pub new_state: u32,
}

/// What a request meets: its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub errno: i32,
    pub immediately: bool,
    pub delay_ns: u64,
}

/// The rules and the state.
#[derive(Debug, Clone, Default)]
pub struct Rules {
    state: u32,
    /// With a unique id each, in definition order.
    inject: Vec<(u64, InjectRule)>,
    set_state: Vec<SetStateRule>,
    /// Ids of the armed inject rules, in definition order.
    active: Vec<u64>,
}

impl Rules {
    pub fn new(inject: Vec<InjectRule>, set_state: Vec<SetStateRule>) -> Self {
        Rules {
            state: 1,
            inject: inject.into_iter().zip(0..).map(|(r, i)| (i, r)).collect(),
            set_state,
            active: Vec::new(),
        }
    }

    pub fn state(&self) -> u32 {
        self.state
    }

    /// Event `e` happened.
    pub fn event(&mut self, e: DebugEvent) {
        let old = self.state;
        let matches =
            |rule_event: DebugEvent, state: u32| rule_event == e && (state == 0 || state == old);
        let armed: Vec<u64> = self
            .inject
            .iter()
            .filter(|(_, r)| matches(r.event, r.state))
            .map(|(id, _)| *id)
            .collect();
        if !armed.is_empty() {
            self.active = armed;
        }
        if let Some(r) = self.set_state.iter().find(|r| matches(r.event, r.state)) {
            self.state = r.new_state;
        }
    }

    /// Whether any inject rule is armed (a request need not ask otherwise).
    pub fn armed(&self) -> bool {
        !self.active.is_empty()
    }

    /// A request of `kind` over `[offset, offset + bytes)`: the fault it meets, if any.
    pub fn check(&mut self, kind: IoType, offset: u64, bytes: u64) -> Option<Fault> {
        let hit = self.active.iter().copied().find(|id| {
            let Some((_, r)) = self.inject.iter().find(|(i, _)| i == id) else {
                return false;
            };
            r.iotypes & kind as u8 != 0
                && match r.sector {
                    None => true,
                    Some(s) => {
                        let at = s.saturating_mul(512);
                        bytes > 0 && at >= offset && at < offset + bytes
                    }
                }
        })?;
        let pos = self.inject.iter().position(|(i, _)| *i == hit)?;
        let r = self.inject[pos].1.clone();
        if r.errno == 0 {
            return None;
        }
        if r.once {
            self.inject.remove(pos);
            self.active.retain(|&i| i != hit);
        }
        Some(Fault {
            errno: r.errno,
            immediately: r.immediately,
            delay_ns: r.delay_ns,
        })
    }
}

impl Fault {
    /// The error the request fails with.
    pub fn error(&self) -> io::Error {
        io::Error::from_raw_os_error(self.errno)
    }
}

fn invalid(s: impl Into<String>) -> GraphError {
    GraphError::Invalid(s.into())
}

fn event_of(v: Option<String>) -> Result<DebugEvent, GraphError> {
    let Some(v) = v else {
        return Err(invalid("Missing event name for rule"));
    };
    DebugEvent::from_name(&v).ok_or_else(|| invalid(format!("invalid parameter value: {v}")))
}

fn number<T: std::str::FromStr>(key: &str, v: Option<String>, default: T) -> Result<T, GraphError> {
    match v {
        None => Ok(default),
        Some(s) => s
            .parse()
            .map_err(|_| invalid(format!("Parameter '{key}' expects a number"))),
    }
}

fn flag(key: &str, v: Option<String>) -> Result<bool, GraphError> {
    match v.as_deref() {
        None => Ok(false),
        Some("on" | "true" | "yes") => Ok(true),
        Some("off" | "false" | "no") => Ok(false),
        Some(_) => Err(invalid(format!("Parameter '{key}' expects 'on' or 'off'"))),
    }
}

/// An inject-error rule from its members (`event`, `state`, `iotype`, `errno`,
/// `sector`, `once`, `immediately`, `delay-ns`), taken from `take`.
pub fn inject_rule(take: &mut dyn FnMut(&str) -> Option<String>) -> Result<InjectRule, GraphError> {
    let event = event_of(take("event"))?;
    let iotypes = match take("iotype") {
        None => DEFAULT_IOTYPES,
        Some(t) => IoType::from_name(&t)
            .ok_or_else(|| invalid(format!("Parameter 'iotype' does not accept value '{t}'")))?
            as u8,
    };
    Ok(InjectRule {
        event,
        state: number("state", take("state"), 0)?,
        iotypes,
        errno: number("errno", take("errno"), libc::EIO)?,
        sector: match take("sector") {
            None => None,
            Some(s) => match s.parse::<i64>() {
                Ok(n) if n < 0 => None,
                Ok(n) => Some(n as u64),
                Err(_) => return Err(invalid("Parameter 'sector' expects a number")),
            },
        },
        once: flag("once", take("once"))?,
        immediately: flag("immediately", take("immediately"))?,
        delay_ns: number("delay-ns", take("delay-ns"), 0)?,
    })
}

/// A set-state rule from its members (`event`, `state`, `new_state`).
pub fn set_state_rule(
    take: &mut dyn FnMut(&str) -> Option<String>,
) -> Result<SetStateRule, GraphError> {
    Ok(SetStateRule {
        event: event_of(take("event"))?,
        state: number("state", take("state"), 0)?,
        new_state: number("new_state", take("new_state"), 0)?,
    })
}

/// The `inject-error.N.*` and `set-state.N.*` lists of the node's options.
pub fn from_options(kv: &mut KeyVal) -> Result<(Vec<InjectRule>, Vec<SetStateRule>), GraphError> {
    // QAPI's check of the required members comes first, in its words.
    let required = |r: &KeyVal, list: &str, n: usize, keys: &[&str]| {
        if let Some(k) = keys.iter().find(|k| r.get(k).is_none()) {
            return Err(invalid(format!("Parameter '{list}.{n}.{k}' is missing")));
        }
        match r.get("event") {
            Some(e) if DebugEvent::from_name(e).is_none() => Err(invalid(format!(
                "Parameter 'event' does not accept value '{e}'"
            ))),
            _ => Ok(()),
        }
    };
    let mut inject = Vec::new();
    while let Some(mut r) = kv.take_prefixed(&format!("inject-error.{}", inject.len())) {
        required(&r, "inject-error", inject.len(), &["event"])?;
        let rule = inject_rule(&mut |k| r.take(k))?;
        r.finish()?;
        inject.push(rule);
    }
    let mut set = Vec::new();
    while let Some(mut r) = kv.take_prefixed(&format!("set-state.{}", set.len())) {
        required(&r, "set-state", set.len(), &["event", "state", "new_state"])?;
        let rule = set_state_rule(&mut |k| r.take(k))?;
        r.finish()?;
        set.push(rule);
    }
    Ok((inject, set))
}

/// A config file (QEMU's QemuOpts ini: `[inject-error]` and `[set-state]` groups of
/// `key = "value"` lines, `#` comments), its errors in QEMU's words.
pub fn from_config(text: &str) -> Result<(Vec<InjectRule>, Vec<SetStateRule>), GraphError> {
    let mut groups: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for raw in text.lines() {
        let line = raw.trim();
        let at = |what: &str| invalid(what.to_string());
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest
                .trim_end_matches(']')
                .split_whitespace()
                .next()
                .unwrap_or("");
            if name != "inject-error" && name != "set-state" {
                return Err(at(&format!("There is no option group '{name}'")));
            }
            groups.push((name.to_string(), Vec::new()));
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            return Err(at("parse error"));
        };
        let v = v.trim();
        let Some(v) = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')) else {
            return Err(at("parse error"));
        };
        let Some(g) = groups.last_mut() else {
            return Err(at("no group defined"));
        };
        g.1.push((k.trim().to_string(), v.to_string()));
    }
    let (mut inject, mut set) = (Vec::new(), Vec::new());
    for (name, mut pairs) in groups {
        let mut take = |k: &str| {
            let i = pairs.iter().position(|p| p.0 == k)?;
            Some(pairs.remove(i).1)
        };
        if name == "inject-error" {
            inject.push(inject_rule(&mut take)?);
        } else {
            set.push(set_state_rule(&mut take)?);
        }
        if let Some((k, _)) = pairs.first() {
            return Err(invalid(format!("Invalid parameter '{k}'")));
        }
    }
    Ok((inject, set))
}

#[cfg(test)]
mod tests {
    use super::*;
    use DebugEvent::*;

    fn rule(event: DebugEvent, state: u32, once: bool) -> InjectRule {
        InjectRule {
            event,
            state,
            iotypes: DEFAULT_IOTYPES,
            errno: libc::ENOSPC,
            sector: None,
            once,
            immediately: false,
            delay_ns: 0,
        }
    }

    #[test]
    fn events_arm_rules_for_the_requests_after_them() {
        let mut r = Rules::new(vec![rule(WriteAio, 0, false)], vec![]);
        assert_eq!(r.check(IoType::Write, 0, 512), None);
        r.event(WriteAio);
        assert_eq!(r.check(IoType::Write, 0, 512).unwrap().errno, libc::ENOSPC);
        // Not once: it keeps failing; an event that arms nothing leaves it armed.
        r.event(ReadAio);
        assert!(r.check(IoType::Read, 0, 512).is_some());
        // Block status is not among the default kinds.
        assert!(r.check(IoType::BlockStatus, 0, 512).is_none());
    }

    #[test]
    fn once_deletes_the_rule_and_states_gate_it() {
        let set = vec![SetStateRule {
            event: WriteAio,
            state: 1,
            new_state: 2,
        }];
        let mut r = Rules::new(vec![rule(WriteAio, 2, true)], set);
        r.event(WriteAio);
        // Checked against the old state (1): not armed, but the state is 2 now.
        assert_eq!(r.state(), 2);
        assert!(r.check(IoType::Write, 0, 512).is_none());
        r.event(WriteAio);
        assert!(r.check(IoType::Write, 0, 512).is_some());
        assert!(r.check(IoType::Write, 0, 512).is_none(), "once fired once");
        r.event(WriteAio);
        assert!(
            r.check(IoType::Write, 0, 512).is_none(),
            "a deleted rule is gone"
        );
    }

    #[test]
    fn sectors_match_inside_the_request_and_never_a_flush() {
        let mut x = rule(ReadAio, 0, false);
        x.sector = Some(8);
        let mut r = Rules::new(vec![x], vec![]);
        r.event(ReadAio);
        assert!(r.check(IoType::Read, 0, 4096).is_none());
        assert!(r.check(IoType::Read, 4096, 512).is_some());
        assert!(r.check(IoType::Flush, 0, 0).is_none());
    }

    #[test]
    fn config_files_parse_as_qemus() {
        let text = "# a comment\n[inject-error]\nevent = \"read_aio\"\nerrno = \"28\"\n\n\
                    [set-state]\nevent = \"write_aio\"\nstate = \"1\"\nnew_state = \"2\"\n";
        let (i, s) = from_config(text).unwrap();
        assert_eq!((i[0].event, i[0].errno), (ReadAio, 28));
        assert_eq!(s[0].new_state, 2);
        let e = from_config("event = \"x\"\n").unwrap_err().to_string();
        assert_eq!(e, "no group defined");
        let e = from_config("[nope]\n").unwrap_err().to_string();
        assert_eq!(e, "There is no option group 'nope'");
        let e = from_config("[inject-error]\nevent = read_aio\n")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "parse error");
        let e = from_config("[inject-error]\nevent = \"l9\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "invalid parameter value: l9");
    }
}
