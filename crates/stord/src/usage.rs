//! `--help`, `--object help` and `--object TYPE,help`, generated from the tables (the
//! object types, the block drivers, the export types), so the help names everything they
//! hold; docs/usage.md carries the same synopses and a test holds it to them. [`man`]
//! writes the same, with the QMP commands, as the manual page.

pub mod man;

use crate::block::drivers::BLOCK_DRIVERS;
use crate::cli::Help;
use crate::daemon::objects::OBJECT_TYPES;
use crate::export::types::EXPORT_TYPES;

/// Where an entry's text starts and where its description does.
const INDENT: usize = 2;
const ABOUT_COLUMN: usize = 28;

/// One table entry as the help shows it.
pub struct Entry {
    /// The option (`--blockdev`).
    pub option: &'static str,
    /// What selects it (`driver=file|host_device,node-name=<name>`).
    pub head: String,
    /// Its first name (`file`): docs/usage.md's heading.
    pub name: &'static str,
    pub help: Help,
}

impl Entry {
    /// The option, its selector and its synopsis, continuation lines indented under the
    /// selector.
    pub fn synopsis(&self) -> String {
        let lead = " ".repeat(INDENT + self.option.len() + 1);
        let mut lines = self.help.synopsis.lines();
        let first = lines.next().unwrap_or_default();
        let sep = if first.is_empty() || first.starts_with(['[', ',']) {
            ""
        } else {
            ","
        };
        let mut out = format!(
            "{}{} {}{sep}{first}\n",
            " ".repeat(INDENT),
            self.option,
            self.head
        );
        for l in lines {
            out.push_str(&format!("{lead}{}\n", l.trim_start()));
        }
        out
    }

    /// The synopsis, then the description in its column.
    fn render(&self) -> String {
        let mut out = self.synopsis();
        for l in self.help.about.lines() {
            out.push_str(&format!("{}{}\n", " ".repeat(ABOUT_COLUMN), l.trim_start()));
        }
        out
    }
}

/// Every object type, block driver and export type, in the help's order.
pub fn entries() -> Vec<Entry> {
    let objects = OBJECT_TYPES.iter().map(|t| Entry {
        option: "--object",
        head: format!("{},id=<id>", t.name),
        name: t.name,
        help: t.help,
    });
    let drivers = BLOCK_DRIVERS.iter().map(|d| Entry {
        option: "--blockdev",
        head: format!("driver={},node-name=<name>", d.names.join("|")),
        name: d.names[0],
        help: d.help,
    });
    let exports = EXPORT_TYPES.iter().map(|t| Entry {
        option: "--export",
        head: format!("type={},id=<id>,node-name=<name>", t.name),
        name: t.name,
        help: t.help,
    });
    objects.chain(drivers).chain(exports).collect()
}

/// What stord is, in the words `--help` opens with and the man page's description uses.
pub const SUMMARY: &str = "\
Serve block nodes over NBD, FUSE and vhost-user-blk, with qemu-storage-daemon's
command-line syntax.
With no options, serves data/default.img (created sparse, 1 GiB) over NBD on a unix socket.";

/// An option outside the tables, as `--help` prints it and the man page lists it.
pub struct Plain {
    /// The option as written (`--nbd-server`, `-h, --help`).
    pub option: &'static str,
    /// What follows it, lines broken with `\n` (continuations start with `|` or `[`), or
    /// nothing.
    pub synopsis: &'static str,
    /// What it does, lines broken with `\n`.
    pub about: &'static str,
}

impl Plain {
    /// The option and its synopsis, continuation lines indented under the first value.
    pub fn synopsis_lines(&self) -> Vec<String> {
        let lead = " ".repeat(self.option.len() + 1);
        let mut lines = self.synopsis.lines();
        let first = match lines.next() {
            Some(first) => format!("{} {first}", self.option),
            None => self.option.to_string(),
        };
        std::iter::once(first)
            .chain(lines.map(|l| format!("{lead}{l}")))
            .collect()
    }

    /// The synopsis, then the description in its column (on the same line when a
    /// one-line synopsis leaves room).
    fn render(&self) -> String {
        let synopsis = self.synopsis_lines();
        let mut about = self.about.lines();
        let mut out = String::new();
        for (i, l) in synopsis.iter().enumerate() {
            let line = format!("{}{l}", " ".repeat(INDENT));
            if synopsis.len() == 1 && line.len() + 2 <= ABOUT_COLUMN && i == 0 {
                let first = about.next().unwrap_or_default();
                out.push_str(&format!("{line:ABOUT_COLUMN$}{first}\n"));
            } else {
                out.push_str(&format!("{line}\n"));
            }
        }
        for l in about {
            out.push_str(&format!("{}{l}\n", " ".repeat(ABOUT_COLUMN)));
        }
        out
    }
}

/// The options that only answer a question.
pub const GENERAL: &[Plain] = &[
    Plain {
        option: "-h, --help",
        synopsis: "",
        about: "show this help",
    },
    Plain {
        option: "-V, --version",
        synopsis: "",
        about: "show the version: the QEMU interface's, then stord's own",
    },
];

/// What every `--blockdev` takes besides its driver's options.
pub const NODE_OPTIONS: &str = "\
every --blockdev (also a JSON object) takes read-only=on|off,
detect-zeroes=off|on|unmap, discard=ignore|unmap,
force-share=on|off, cache.direct/cache.no-flush=on|off and
active=on|off (off: inactive, until blockdev-set-active);
inline children (file.driver=...) inherit them as QEMU's do";

pub const NBD_SERVER: Plain = Plain {
    option: "--nbd-server",
    synopsis: "addr.type=unix,addr.path=<path>
| addr.type=inet,addr.host=<host>,addr.port=<port>
[,addr.keep-alive=on[,addr.keep-alive-count|-idle|-interval=<n>]]
[,max-connections=<n>][,handshake-max-seconds=<s>]
[,tls-creds=<id>[,tls-authz=<id>]]",
    about: "the NBD server; with tls-creds every client must use TLS",
};

/// The monitor and the process.
pub const PROCESS: &[Plain] = &[
    Plain {
        option: "--chardev",
        synopsis: "socket,id=<id>,path=<path>[,server=on,wait=off]
| socket,id=<id>,host=<host>,port=<port>[,server=on,wait=off] | stdio,id=<id>
| ringbuf,id=<id>[,size=<n>] | memory,id=<id>[,size=<n>] | null,id=<id>
| file,id=<id>,path=<path>[,append=on]
[,logfile=<path>[,logappend=on][,logtimestamp=on]] (any of them)",
        about: "for a monitor, a socket stord listens on (server=on) or
connects to, or stdin and stdout; besides, a ringbuf
(ringbuf-read/-write), null or file device",
    },
    Plain {
        option: "--monitor",
        synopsis: "[chardev=]<id>",
        about: "a QMP monitor on that chardev (a unix socket created 0600)",
    },
    Plain {
        option: "--trace",
        synopsis: "[enable=]<pattern>[,events=<file>][,file=<file>]",
        about: "QEMU trace event names or patterns (nbd_*, qcow2_*, ...):
their stord modules' diagnostics at every level
(--trace help lists the mapping)",
    },
    Plain {
        option: "--pidfile",
        synopsis: "<path>",
        about: "write the process id once everything is ready",
    },
    Plain {
        option: "--daemonize",
        synopsis: "",
        about: "detach once everything is ready (the parent exits 0 then)",
    },
];

/// The help text: every table's entries, in its order.
pub fn text() -> String {
    let entries = entries();
    let of = |option: &str| -> String {
        entries
            .iter()
            .filter(|e| e.option == option)
            .map(Entry::render)
            .collect()
    };
    let plain = |p: &[Plain]| -> String { p.iter().map(Plain::render).collect() };
    let column = |text: &str| -> String {
        let lead = " ".repeat(ABOUT_COLUMN);
        text.lines().map(|l| format!("{lead}{l}\n")).collect()
    };
    [
        format!("Usage: stord [options]\n{SUMMARY}\n\n"),
        plain(GENERAL),
        of("--object"),
        of("--blockdev"),
        column(NODE_OPTIONS),
        NBD_SERVER.render(),
        of("--export"),
        plain(PROCESS),
    ]
    .concat()
}

/// What `--object help` (the types) or `--object TYPE,help` (that type's properties)
/// prints, as qsd answers them. `value` is the option's value.
pub fn object_help(value: &str) -> Result<String, String> {
    let kind = value.trim_end_matches("help").trim_end_matches(',');
    let kind = kind.strip_prefix("qom-type=").unwrap_or(kind);
    if kind.is_empty() {
        let mut out = String::from("List of user creatable objects:\n");
        for t in OBJECT_TYPES {
            out.push_str(&format!("  {}\n", t.name));
        }
        return Ok(out);
    }
    match entries()
        .into_iter()
        .find(|e| e.option == "--object" && e.name == kind)
    {
        Some(e) => Ok(format!("{kind} options:\n{}", e.render())),
        None => Err(format!(
            "--object: unknown object type '{kind}' (supported: {})",
            OBJECT_TYPES
                .iter()
                .map(|t| t.name)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every driver name, export type and object type is in the help, each once as the
    /// start of an entry.
    #[test]
    fn the_help_names_every_table_entry() {
        let help = text();
        let starts = |prefix: String| help.lines().filter(|l| l.starts_with(&prefix)).count();
        for d in BLOCK_DRIVERS {
            let head = format!("  --blockdev driver={},", d.names.join("|"));
            assert_eq!(starts(head), 1, "{:?}", d.names);
        }
        for t in EXPORT_TYPES {
            assert_eq!(
                starts(format!("  --export type={},", t.name)),
                1,
                "{}",
                t.name
            );
        }
        for t in OBJECT_TYPES {
            assert_eq!(starts(format!("  --object {},", t.name)), 1, "{}", t.name);
        }
        for l in help.lines() {
            assert!(l.len() <= 92, "a help line over 92 columns: {l}");
        }
    }

    #[test]
    fn object_help_lists_types_and_one_types_properties() {
        let types = object_help("help").unwrap();
        assert!(
            types.contains("  tls-creds-x509\n") && types.contains("  iothread\n"),
            "{types}"
        );
        assert_eq!(object_help("qom-type=help").unwrap(), types);
        let x509 = object_help("tls-creds-x509,help").unwrap();
        assert!(x509.starts_with("tls-creds-x509 options:\n"), "{x509}");
        assert!(
            x509.contains("verify-peer") && !x509.contains("poll-max-ns"),
            "{x509}"
        );
        assert!(object_help("nope,help")
            .unwrap_err()
            .contains("unknown object type 'nope'"));
    }

    /// docs/usage.md has a section for each entry, in the tables' order, headed by its
    /// name and opening with its synopsis as `--help` prints it.
    #[test]
    fn docs_usage_md_names_every_qmp_command() {
        let doc = include_str!("../../../docs/usage.md");
        let start = doc
            .find("\n## QMP\n")
            .expect("docs/usage.md has no '## QMP'");
        let rest = &doc[start + 1..];
        let section = &rest[..rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3)];
        // `name`, and the shorthands `chardev-add/-change` and `blockdev-add`/`-del` for
        // names that share all but their last word with the name before.
        let mut named = std::collections::HashSet::new();
        let mut base = String::new();
        for token in section.split('`').skip(1).step_by(2) {
            for p in token.split('/') {
                let name = match p.strip_prefix('-') {
                    Some(last) => format!("{base}-{last}"),
                    None => {
                        base = p.rsplit_once('-').map_or(p, |(b, _)| b).to_string();
                        p.to_string()
                    }
                };
                named.insert(name);
            }
        }
        let missing: Vec<&str> = crate::qmp::command_names()
            .filter(|c| !named.contains(*c))
            .collect();
        assert!(
            missing.is_empty(),
            "docs/usage.md's QMP section lacks {missing:?}"
        );
    }

    #[test]
    fn docs_usage_md_follows_the_tables() {
        let doc = include_str!("../../../docs/usage.md");
        let all = entries();
        for (option, title) in [
            ("--object", "Objects"),
            ("--blockdev", "Block drivers"),
            ("--export", "Exports"),
        ] {
            let start = doc
                .find(&format!("\n## {title}\n"))
                .unwrap_or_else(|| panic!("docs/usage.md has no '## {title}'"));
            let rest = &doc[start + 1..];
            let section = &rest[..rest[3..].find("\n## ").map_or(rest.len(), |i| i + 3)];
            let headings: Vec<&str> = section
                .lines()
                .filter_map(|l| l.strip_prefix("### "))
                .collect();
            let ours: Vec<&Entry> = all.iter().filter(|e| e.option == option).collect();
            let names: Vec<&str> = ours.iter().map(|e| e.name).collect();
            assert_eq!(headings, names, "docs/usage.md's '{title}' and the table");
            for e in ours {
                let block = format!("### {}\n\n```text\n{}```\n", e.name, e.synopsis());
                assert!(
                    section.contains(&block),
                    "docs/usage.md's '{title}' lacks this synopsis (as --help prints it):\n{block}"
                );
            }
        }
    }
}
