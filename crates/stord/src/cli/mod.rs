//! The command line, in qemu-storage-daemon's syntax for what stord implements.
//!
//! ```text
//! stord --object iothread,id=io0,poll-max-ns=32768
//!       --blockdev driver=file,node-name=disk,filename=disk.img,aio=io_uring,cache.direct=on
//!       --nbd-server addr.type=unix,addr.path=/tmp/nbd.sock
//!       --export type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0
//!       --pidfile /run/stord.pid
//! ```
//!
//! Each option takes its value as the next argument or after `=`. Values are QEMU
//! key=value lists ([`keyval`]) or JSON objects.

pub mod keyval;

use std::path::PathBuf;

/// How a table entry (a block driver, an export type, an object type) describes itself in
/// `--help` and docs/usage.md.
#[derive(Debug, Clone, Copy)]
pub struct Help {
    /// Its options after the ones that select it (`driver=file,node-name=<name>,`): QEMU's
    /// `[,optional=<value>]` notation, lines broken with `\n`.
    pub synopsis: &'static str,
    /// What it is, in a line or two (`\n` between lines).
    pub about: &'static str,
}

/// One option that creates something, kept in command-line order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// `--object`.
    Object(String),
    /// `--blockdev`.
    Blockdev(String),
    /// `--nbd-server`.
    NbdServer(String),
    /// `--export`.
    Export(String),
    /// `--chardev`.
    Chardev(String),
    /// `--monitor`.
    Monitor(String),
}

/// The parsed command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandLine {
    /// Creating options, in order.
    pub items: Vec<Item>,
    /// `--pidfile`.
    pub pidfile: Option<PathBuf>,
    /// `-h` / `--help`.
    pub help: bool,
    /// `-V` / `--version`.
    pub version: bool,
    /// `--daemonize`.
    pub daemonize: bool,
    /// `--trace` values, in order.
    pub trace: Vec<String>,
    /// `--object help` or `--object TYPE,help`: the value, whose help is printed instead
    /// of running.
    pub object_help: Option<String>,
}

/// QEMU's `id_wellformed`: a letter, then letters, digits, `-`, `.` and `_` (the ids of
/// objects, exports and jobs, and node names, whether given here or over QMP).
pub fn id_wellformed(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
}

/// Whether an `--object` value asks for help (`help`, `qom-type=help`, `TYPE,help`)
/// rather than creating an object.
fn is_object_help(value: &str) -> bool {
    value == "help" || value == "qom-type=help" || value.ends_with(",help")
}

/// Parses the arguments after the program name.
pub fn parse(args: &[String]) -> Result<CommandLine, String> {
    let mut cl = CommandLine::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let needs_value = matches!(
            name,
            "--object"
                | "--blockdev"
                | "--nbd-server"
                | "--export"
                | "--pidfile"
                | "--chardev"
                | "--monitor"
                | "--trace"
        );
        let value = if needs_value {
            match inline {
                Some(v) => Some(v),
                None => {
                    i += 1;
                    Some(
                        args.get(i)
                            .cloned()
                            .ok_or_else(|| format!("option '{name}' requires an argument"))?,
                    )
                }
            }
        } else {
            if inline.is_some() {
                return Err(format!("option '{name}' takes no argument"));
            }
            None
        };
        match name {
            "-h" | "--help" => cl.help = true,
            "-V" | "--version" => cl.version = true,
            "--object" => {
                let v = value.expect("value");
                if is_object_help(&v) {
                    cl.object_help = Some(v);
                } else {
                    cl.items.push(Item::Object(v));
                }
            }
            "--blockdev" => cl.items.push(Item::Blockdev(value.expect("value"))),
            "--nbd-server" => cl.items.push(Item::NbdServer(value.expect("value"))),
            "--export" => cl.items.push(Item::Export(value.expect("value"))),
            "--pidfile" => cl.pidfile = Some(PathBuf::from(value.expect("value"))),
            "--chardev" => cl.items.push(Item::Chardev(value.expect("value"))),
            "--monitor" => cl.items.push(Item::Monitor(value.expect("value"))),
            "--daemonize" => cl.daemonize = true,
            "--trace" => cl.trace.push(value.expect("value")),
            other => {
                return Err(format!(
                    "unrecognized option '{other}' (supported: --object, --blockdev, --nbd-server, --export, \
                     --chardev, --monitor, --trace, --pidfile, --daemonize, --help, --version)"
                ))
            }
        }
        i += 1;
    }
    Ok(cl)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_qsd_style_options() {
        let cl = parse(&args(&[
            "--object",
            "iothread,id=io0",
            "--blockdev=driver=null-co,node-name=n0",
            "--nbd-server",
            "addr.type=unix,addr.path=/tmp/x",
            "--export",
            "type=nbd,id=e,node-name=n0",
            "--pidfile",
            "/tmp/pid",
        ]))
        .unwrap();
        assert_eq!(cl.items.len(), 4);
        assert_eq!(
            cl.items[1],
            Item::Blockdev("driver=null-co,node-name=n0".into())
        );
        assert_eq!(cl.pidfile, Some(PathBuf::from("/tmp/pid")));
    }

    #[test]
    fn errors_name_the_option() {
        assert!(parse(&args(&["--bogus"])).unwrap_err().contains("--bogus"));
        assert!(parse(&args(&["--blockdev"]))
            .unwrap_err()
            .contains("--blockdev"));
        assert!(parse(&args(&["--help=x"])).unwrap_err().contains("--help"));
        let asks = |v: &str| parse(&args(&["--object", v])).unwrap().object_help;
        assert_eq!(asks("help").as_deref(), Some("help"));
        assert_eq!(asks("secret,help").as_deref(), Some("secret,help"));
        assert_eq!(asks("iothread,id=x"), None);
    }
}
