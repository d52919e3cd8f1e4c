//! `man stord`: the manual page, written in roff from what `--help` prints (the object,
//! driver and export tables, the options outside them) and the QMP command table, so the
//! page names everything stord takes and cannot part from the code. docs/stord.1 is the
//! page as generated; a test holds it to this writer (`STORD_WRITE_MAN=1 cargo test -p
//! stord --lib usage::` writes it anew), and the Debian package installs it.

use super::{entries, Entry, Plain, GENERAL, NBD_SERVER, NODE_OPTIONS, PROCESS, SUMMARY};
use crate::qmp::command_names;
use crate::version::{QemuVersion, QEMU_INTERFACE};

/// Text as roff reads it literally: backslashes and minus signs escaped, a line that would
/// start a request (`.` or `'`) guarded.
fn escape(text: &str) -> String {
    text.lines()
        .map(|l| {
            let l = l.replace('\\', "\\e").replace('-', "\\-");
            if l.starts_with(['.', '\'']) {
                format!("\\&{l}")
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Lines broken for the terminal joined into one paragraph (roff fills it again).
fn paragraph(text: &str) -> String {
    let words: Vec<&str> = text.lines().map(str::trim).collect();
    escape(&words.join(" "))
}

/// A synopsis as `--help` prints it (kept as laid out), then what it is, indented.
fn synopsis_block(lines: &[String], about: &str) -> String {
    let lines: Vec<String> = lines.iter().map(|l| escape(l)).collect();
    format!(
        ".PP\n.nf\n{}\n.fi\n.RS 4\n{}\n.RE\n",
        lines.join("\n"),
        paragraph(about)
    )
}

fn entry(e: &Entry) -> String {
    let lines: Vec<String> = e
        .synopsis()
        .lines()
        .map(|l| l[super::INDENT..].to_string())
        .collect();
    synopsis_block(&lines, e.help.about)
}

fn plain(p: &Plain) -> String {
    synopsis_block(&p.synopsis_lines(), p.about)
}

/// A section or subsection's heading and opening paragraph.
fn heading(request: &str, title: &str, intro: &str) -> String {
    let mut out = format!(".{request} {title}\n");
    if !intro.is_empty() {
        out.push_str(&format!(".PP\n{}\n", paragraph(intro)));
    }
    out
}

const DESCRIPTION: &str = "\
stord takes qemu-storage-daemon's command line and QMP where the two overlap, so a
qemu-storage-daemon command line or QMP script runs on stord by changing the program name.
Each option takes QEMU's key=value,... syntax (a comma inside a value is written ,,) or a
JSON object.";

const REFERENCE: &str = "\
The options, drivers, exports and commands below are generated from stord's own tables.
What each of them does in detail, and what the daemon guarantees (locking, the stop,
limits), is in usage.md beside this program's other documentation
(/usr/share/doc/stord/ where it was installed as a package).";

const OBJECTS: &str = "\
--object TYPE,id=ID,... on the command line, object-add over QMP. --object help lists the
types, --object TYPE,help one type's properties.";

const BLOCK_DRIVERS: &str = "\
--blockdev driver=...,node-name=NAME,... on the command line, blockdev-add over QMP.";

const EXPORTS: &str = "\
--export type=...,id=ID,node-name=NAME,... on the command line, block-export-add over QMP.
Every export takes writethrough=on.";

const QMP: &str = "\
A --monitor speaks QMP as qemu-storage-daemon does: the greeting and query-version report
the QEMU version whose interface stord implements, with stord's own name and version as the
package. query-qmp-schema describes each command's arguments. The commands:";

const STOPPING: &str = "\
SIGINT, SIGTERM and the QMP command quit stop stord cleanly: exports go, jobs are
cancelled, writable nodes are flushed, then it exits with status 0. When storage stops
answering, the stop still ends (at once on a second signal) with status 1. A command line
stord cannot apply makes it exit with status 1 before it serves anything.";

const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "STORD_LOG",
        "off, error, warn (the default), info, debug or trace: what is logged to standard
error.",
    ),
    (
        "STORD_AIO_REACTOR",
        "io_uring or epoll: what reactor=auto means, for every event loop stord makes.",
    ),
    (
        "STORD_DATA_DIR",
        "where the built-in default (no options) keeps its image and socket; by default
data/ in the current directory, or in the source tree a binary built there runs from.",
    ),
    (
        "NOTIFY_SOCKET",
        "set by systemd for a Type=notify service: stord reports READY=1 there once
everything on its command line is served.",
    ),
];

const FILES: &[(&str, &str)] = &[
    (
        "/lib/systemd/system/stord@.service",
        "a daemon per instance: systemctl start stord@NAME runs stord with the options
that STORD_ARGS holds in /etc/stord/NAME.conf (an environment file), and tells systemd it
is ready once they are all served; /run/stord/NAME/ is made for its sockets.",
    ),
    (
        "/etc/stord/NAME.conf",
        "the options of instance NAME, as STORD_ARGS=\"--blockdev ... --export ...\".",
    ),
];

const EXAMPLE: &str = "\
stord --object iothread,id=io0 \\
      --blockdev driver=file,node-name=disk,filename=disk.img,aio=io_uring \\
      --nbd-server addr.type=unix,addr.path=/tmp/nbd.sock \\
      --export type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0 \\
      --pidfile /tmp/stord.pid";

const SEE_ALSO: &str = "\
\\fBqemu\\-storage\\-daemon\\fR(1), \\fBqemu\\-img\\fR(1), \\fBqemu\\-io\\fR(1),
\\fBnbdinfo\\fR(1), \\fBsystemd.service\\fR(5)";

/// Tagged paragraphs: each name in bold, its text below.
fn tagged(items: &[(&str, &str)]) -> String {
    items
        .iter()
        .map(|(tag, text)| format!(".TP\n.B {}\n{}\n", escape(tag), paragraph(text)))
        .collect()
}

/// Every QMP command name, bold, one after the other.
fn commands() -> String {
    let names: Vec<String> = command_names()
        .map(|n| format!("\\fB{}\\fR", escape(n)))
        .collect();
    format!(".PP\n{}\n", names.join(",\n"))
}

/// The page's head: title, name, synopsis, description.
fn head() -> String {
    let QemuVersion {
        major,
        minor,
        micro,
    } = QEMU_INTERFACE;
    let interface =
        format!("stord implements the interface of qemu-storage-daemon {major}.{minor}.{micro}.");
    [
        format!(
            ".TH STORD 1 \"\" \"stord {}\" \"User Commands\"\n.nh\n.ad l\n",
            env!("CARGO_PKG_VERSION")
        ),
        ".SH NAME\nstord \\- storage daemon with qemu\\-storage\\-daemon's command line and QMP\n"
            .to_string(),
        ".SH SYNOPSIS\n.B stord\n[\\fIoptions\\fR]\n".to_string(),
        heading("SH", "DESCRIPTION", SUMMARY),
        format!(".PP\n{}\n", paragraph(DESCRIPTION)),
        format!(".PP\n{}\n", paragraph(&interface)),
        format!(".PP\n{}\n", paragraph(REFERENCE)),
    ]
    .concat()
}

/// The manual page, in roff.
pub fn page() -> String {
    let all = entries();
    let of = |option: &str| -> String {
        all.iter()
            .filter(|e| e.option == option)
            .map(entry)
            .collect()
    };
    [
        head(),
        ".SH OPTIONS\n".to_string(),
        GENERAL.iter().map(plain).collect(),
        heading("SS", "Objects", OBJECTS),
        of("--object"),
        heading("SS", "Block drivers", BLOCK_DRIVERS),
        format!(".PP\n{}\n", paragraph(NODE_OPTIONS)),
        of("--blockdev"),
        heading("SS", "The NBD server", ""),
        plain(&NBD_SERVER),
        heading("SS", "Exports", EXPORTS),
        of("--export"),
        heading("SS", "The monitor and the process", ""),
        PROCESS.iter().map(plain).collect(),
        heading("SH", "QMP COMMANDS", QMP),
        commands(),
        heading("SH", "EXIT STATUS", STOPPING),
        ".SH ENVIRONMENT\n".to_string(),
        tagged(ENVIRONMENT),
        ".SH FILES\n".to_string(),
        tagged(FILES),
        format!(".SH EXAMPLES\n.PP\n.nf\n{}\n.fi\n", escape(EXAMPLE)),
        format!(".SH SEE ALSO\n{SEE_ALSO}\n"),
    ]
    .concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/stord.1 is this writer's page (`STORD_WRITE_MAN=1` writes it anew).
    #[test]
    fn docs_stord_1_is_the_generated_page() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/stord.1");
        let page = page();
        if std::env::var_os("STORD_WRITE_MAN").is_some() {
            std::fs::write(path, &page).expect("write docs/stord.1");
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == page,
            "docs/stord.1 is not the page the tables give: run \
             STORD_WRITE_MAN=1 cargo test -p stord --lib usage:: and commit it"
        );
    }

    /// The page names every option, object type, block driver, export type and QMP
    /// command, each as roff writes it.
    #[test]
    fn the_page_names_everything() {
        let page = page();
        let has = |what: &str| page.contains(&escape(what));
        for e in entries() {
            let first = e.synopsis().lines().next().unwrap()[super::super::INDENT..].to_string();
            assert!(has(&first), "{first}");
        }
        for p in GENERAL.iter().chain(PROCESS).chain([&NBD_SERVER]) {
            assert!(has(p.option), "{}", p.option);
        }
        let names: Vec<&str> = command_names().collect();
        assert!(names.len() > 70 && names.contains(&"query-version"));
        for c in names {
            assert!(page.contains(&format!("\\fB{}\\fR", escape(c))), "{c}");
        }
        // Filled text never starts a line with a space (roff would break there); the
        // synopses between .nf and .fi keep their layout.
        let mut filled = true;
        for l in page.lines() {
            filled = match l {
                ".nf" => false,
                ".fi" => true,
                _ => filled,
            };
            assert!(
                !(filled && l.starts_with(' ')),
                "filled text starts with a space: {l:?}"
            );
        }
        assert!(page.starts_with(".TH STORD 1 "));
        assert!(page.contains("\n.SH NAME\nstord \\- "));
    }

    #[test]
    fn escapes_what_roff_would_read() {
        assert_eq!(escape(".x -y \\z"), "\\&.x \\-y \\ez");
        assert_eq!(escape("'a"), "\\&'a");
        assert_eq!(paragraph("a\n  b"), "a b");
    }
}
