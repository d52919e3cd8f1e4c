//! `--trace`: QEMU's trace options mapped onto stord's tracing targets.
//!
//! QEMU names trace events by subsystem (`nbd_co_request_fail`, `qcow2_writev_start`,
//! `luring_do_submit`); stord's diagnostics are `tracing` events whose targets are module
//! paths. A QEMU event name or pattern selects the stord modules of its subsystem (the
//! [`GROUPS`] table), whose events are then shown at every level; `-PATTERN` turns a
//! subsystem off again, `events=FILE` reads one name or pattern a line (`#` comments), and
//! `file=FILE` sends the output there instead of stderr. A name that selects nothing is
//! warned about as QEMU warns (`trace event 'x' does not exist`), and so is a pattern.

use std::path::PathBuf;

use crate::cli::keyval::KeyVal;

/// One QEMU trace subsystem (its events' name prefix) and the stord modules that do its
/// work.
pub struct Group {
    pub qemu: &'static str,
    pub targets: &'static [&'static str],
}

/// `stord::nbd` is the target the NBD client driver names in its events.
const NBD: &[&str] = &[
    "stord::nbd",
    "stord::nbd_wire",
    "stord::export::nbd",
    "stord::block::drivers::nbd_client",
];
const FILE: &[&str] = &["stord::block::drivers::file"];
const JOBS: &[&str] = &["stord::job", "stord::daemon::jobs"];
const LOOP: &[&str] = &["stord_aio"];

/// QEMU's subsystems, by the prefix of their event names.
pub const GROUPS: &[Group] = &[
    Group {
        qemu: "nbd",
        targets: NBD,
    },
    Group {
        qemu: "qcow2",
        targets: &["stord::block::drivers::qcow2"],
    },
    Group {
        qemu: "file",
        targets: FILE,
    },
    Group {
        qemu: "luring",
        targets: FILE,
    },
    Group {
        qemu: "laio",
        targets: FILE,
    },
    Group {
        qemu: "paio",
        targets: FILE,
    },
    Group {
        qemu: "fuse",
        targets: &["stord::export::fuse"],
    },
    Group {
        qemu: "vu",
        targets: &["stord::export::vhost_user_blk", "stord::export::virtio_blk"],
    },
    Group {
        qemu: "vhost_user",
        targets: &["stord::export::vhost_user_blk", "stord::export::virtio_blk"],
    },
    Group {
        qemu: "qemu_rbd",
        targets: &["stord::block::drivers::rbd"],
    },
    Group {
        qemu: "throttle",
        targets: &[
            "stord::block::drivers::throttle",
            "stord::block::throttle_group",
        ],
    },
    Group {
        qemu: "monitor",
        targets: &["stord::qmp", "stord::events"],
    },
    Group {
        qemu: "handle_qmp_command",
        targets: &["stord::qmp"],
    },
    Group {
        qemu: "job",
        targets: JOBS,
    },
    Group {
        qemu: "block_job",
        targets: JOBS,
    },
    Group {
        qemu: "mirror",
        targets: &["stord::job::mirror"],
    },
    Group {
        qemu: "stream",
        targets: &["stord::job::stream"],
    },
    Group {
        qemu: "commit",
        targets: &["stord::job::commit"],
    },
    Group {
        qemu: "bdrv",
        targets: &["stord::block", "stord::daemon"],
    },
    Group {
        qemu: "blk",
        targets: &["stord::block"],
    },
    Group {
        qemu: "aio",
        targets: LOOP,
    },
    Group {
        qemu: "poll",
        targets: LOOP,
    },
    Group {
        qemu: "iothread",
        targets: LOOP,
    },
    Group {
        qemu: "thread_pool",
        targets: &[
            "stord::block::worker_pool",
            "stord::block::drivers::file::threads",
        ],
    },
    Group {
        qemu: "qcrypto_tls",
        targets: &["stord::tls"],
    },
    Group {
        qemu: "blkdebug",
        targets: &["stord::block::drivers::blkdebug"],
    },
    Group {
        qemu: "qcrypto_block",
        targets: &["stord::crypto", "stord::block::drivers::luks"],
    },
];

/// What the `--trace` options ask for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TraceConfig {
    /// Module targets shown at every level, in the order they were turned on.
    pub targets: Vec<&'static str>,
    /// Where the output goes (`file=`), else stderr.
    pub file: Option<PathBuf>,
    /// Names and patterns that selected nothing, in QEMU's words.
    pub warnings: Vec<String>,
}

/// Whether `pattern` (QEMU's `*` and `?`) matches all of `s`.
fn glob(pattern: &[u8], s: &[u8]) -> bool {
    match (pattern.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => glob(&pattern[1..], s) || (!s.is_empty() && glob(pattern, &s[1..])),
        (Some(b'?'), Some(_)) => glob(&pattern[1..], &s[1..]),
        (Some(p), Some(c)) if p == c => glob(&pattern[1..], &s[1..]),
        _ => false,
    }
}

/// Whether event name or pattern `p` names an event of subsystem `prefix` (whose events
/// are `prefix_...`).
fn selects(p: &str, prefix: &str) -> bool {
    let events = format!("{prefix}_");
    if !p.contains(['*', '?']) {
        return p.starts_with(&events);
    }
    // A pattern selects the subsystem if it matches some name `prefix_...`.
    glob(p.as_bytes(), format!("{events}x").as_bytes())
        || p.split(['*', '?'])
            .next()
            .is_some_and(|lit| lit.starts_with(&events))
        || glob(p.as_bytes(), prefix.as_bytes())
}

impl TraceConfig {
    /// Applies one name or pattern (`-` first: off).
    fn apply(&mut self, line: &str) {
        let (on, p) = match line.strip_prefix('-') {
            Some(p) => (false, p),
            None => (true, line),
        };
        let groups: Vec<&Group> = GROUPS.iter().filter(|g| selects(p, g.qemu)).collect();
        if groups.is_empty() {
            self.warnings.push(if p.contains(['*', '?']) {
                format!("trace pattern '{p}' matches no trace event stord has")
            } else {
                format!("trace event '{p}' does not exist")
            });
        }
        for t in groups.iter().flat_map(|g| g.targets.iter().copied()) {
            self.targets.retain(|x| *x != t);
            if on {
                self.targets.push(t);
            }
        }
    }

    /// Reads the `--trace` options (`[enable=]PATTERN`, `events=FILE`, `file=FILE`).
    pub fn from_options(values: &[String]) -> Result<TraceConfig, String> {
        let mut cfg = TraceConfig::default();
        for v in values {
            let mut kv = KeyVal::parse("--trace", v, Some("enable")).map_err(|e| e.to_string())?;
            if let Some(p) = kv.take("enable") {
                cfg.apply(&p);
            }
            if let Some(f) = kv.take("events") {
                let text =
                    std::fs::read_to_string(&f).map_err(|e| format!("--trace events={f}: {e}"))?;
                for line in text
                    .lines()
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                {
                    cfg.apply(line.trim_end());
                }
            }
            if let Some(f) = kv.take("file") {
                cfg.file = Some(PathBuf::from(f));
            }
            kv.finish().map_err(|e| e.to_string())?;
        }
        Ok(cfg)
    }
}

/// What `--trace help` prints: each QEMU subsystem and the stord modules it selects.
pub fn help() -> String {
    let mut out = String::from("QEMU trace event prefixes stord maps onto its modules:\n");
    for g in GROUPS {
        out.push_str(&format!("  {}_*: {}\n", g.qemu, g.targets.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(v: &[&str]) -> TraceConfig {
        TraceConfig::from_options(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn qemu_names_and_patterns_select_their_subsystems() {
        assert_eq!(cfg(&["nbd_*"]).targets, NBD);
        assert_eq!(
            cfg(&["enable=qcow2_writev_start"]).targets,
            ["stord::block::drivers::qcow2"]
        );
        assert_eq!(cfg(&["luring_*", "-file*"]).targets, Vec::<&str>::new());
        assert_eq!(cfg(&["*"]).targets.len(), {
            let mut all: Vec<&str> = GROUPS
                .iter()
                .flat_map(|g| g.targets.iter().copied())
                .collect();
            all.sort_unstable();
            all.dedup();
            all.len()
        });
        let c = cfg(&["no_such_event", "zzz*", "fuse_*,file=/tmp/t.log"]);
        assert_eq!(c.targets, ["stord::export::fuse"]);
        assert_eq!(c.file, Some(PathBuf::from("/tmp/t.log")));
        assert_eq!(
            c.warnings,
            [
                "trace event 'no_such_event' does not exist",
                "trace pattern 'zzz*' matches no trace event stord has"
            ]
        );
        assert!(TraceConfig::from_options(&["x,bogus=1".into()]).is_err());
    }
}
