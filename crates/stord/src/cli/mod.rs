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
    /// `--object help` or `--object TYPE,help`: what to print instead of running.
    pub object_help: Option<String>,
}

/// The `--object` types the help text describes, in its order.
pub fn object_types() -> Vec<&'static str> {
    let mut v: Vec<&str> = USAGE
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("--object "))
        .filter_map(|rest| rest.split(',').next())
        .collect();
    v.dedup();
    v
}

/// What `--object help` (the types) or `--object TYPE,help` (that type's properties, from
/// the help text) prints, as qsd answers them; None for any other `--object` value.
pub fn object_help(value: &str) -> Option<Result<String, String>> {
    let parts: Vec<&str> = value.split(',').collect();
    let kind = match parts.as_slice() {
        ["help"] | ["qom-type=help"] => {
            let mut out = String::from("List of user creatable objects:\n");
            for t in object_types() {
                out.push_str(&format!("  {t}\n"));
            }
            return Some(Ok(out));
        }
        [t, "help"] => t.strip_prefix("qom-type=").unwrap_or(t),
        _ => return None,
    };
    let mut out = String::new();
    let mut inside = false;
    for line in USAGE.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("--") {
            inside = trimmed.starts_with(&format!("--object {kind},"));
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    Some(if out.is_empty() {
        Err(format!(
            "--object: unknown object type '{kind}' (supported: {})",
            object_types().join(", ")
        ))
    } else {
        Ok(format!("{kind} options:\n{out}"))
    })
}

/// The help text.
pub const USAGE: &str = "\
Usage: stord [options]
Serve block nodes over NBD, FUSE and vhost-user-blk, with qemu-storage-daemon's
command-line syntax.
With no options, serves data/default.img (created sparse, 1 GiB) over NBD on a unix socket.

  -h, --help                show this help
  -V, --version             show the version
  --object iothread,id=<id>[,poll-max-ns=<ns> (default 65536)][,poll-grow=<n>][,poll-shrink=<n>]
           [,poll-weight=<0..63>][,poll-policy=off|classic|weighted|haltpoll]
           [,poll-grow-start=<ns>][,poll-allow-shrink=on|off][,poll-yield-ns=<ns>]
           [,reactor=auto|io_uring|epoll]
                            an IoThread (an event loop on its own thread)
  --blockdev driver=null-co|null,node-name=<name>[,size=<size>][,read-zeroes=on|off]
  --blockdev driver=file,node-name=<name>,filename=<path>[,aio=io_uring|native|threads]
             [,cache.direct=on|off][,aio-max-batch=<n>][,x-reap-after-submit=on|off][,discard=unmap|ignore][,read-only=on|off]
  --blockdev driver=raw,node-name=<name>,file=<node> | ,file.driver=<driver>,file.<option>=...
             [,offset=<bytes>][,size=<bytes>]
  --blockdev driver=qcow2,node-name=<name>,file=<node> | ,file.driver=...
             [,backing=<node>|null | ,backing.driver=...][,l2-cache-size=<size>]
             [,refcount-cache-size=<size>][,cache-size=<size>][,discard=unmap|ignore]
  --blockdev driver=throttle,node-name=<name>,throttle-group=<id>,file=<node>
                            a block node (also as a JSON object); raw and qcow2 are format
                            nodes over their child `file`, named or inline; a qcow2 image's
                            backing file opens by itself unless `backing` says otherwise
  --object throttle-group,id=<id>[,x-iops-total=<n>][,x-iops-read=<n>][,x-iops-write=<n>]
           [,x-bps-total=<n>][,x-bps-read=<n>][,x-bps-write=<n>][,x-<limit>-max=<n>]
           [,x-<limit>-max-length=<s>][,x-iops-size=<bytes>] (also limits.<limit>=...)
                            limits shared by the throttle nodes of the group
  --object tls-creds-x509,id=<id>,endpoint=server,dir=<dir>[,verify-peer=on|off][,passwordid=<secret id>]
                            TLS certificates: <dir>/ca-cert.pem, server-cert.pem, server-key.pem
                            (ca-crl.pem if present); verify-peer=on (the default) requires
                            clients to present a certificate the CA signed
  --object tls-creds-psk,id=<id>,endpoint=server,dir=<dir>
                            TLS pre-shared keys: <dir>/keys.psk, username:hexkey per line
  --object authz-simple,id=<id>,identity=<name>
                            the one TLS client admitted: its certificate's name as QEMU writes
                            it (C=GB,,O=Example,,CN=client: commas doubled) or its PSK username
  --object secret,id=<id>,data=<text>|file=<path>[,format=raw|base64]
                            a secret (the passphrase of an encrypted server-key.pem)
  --nbd-server addr.type=unix,addr.path=<path> | addr.type=inet,addr.host=<host>,addr.port=<port>
               [,max-connections=<n>][,handshake-max-seconds=<s>][,tls-creds=<id>[,tls-authz=<id>]]
                            the NBD server; with tls-creds every client must use TLS
  --export type=nbd,id=<id>,node-name=<name>[,name=<export name>][,description=<text>]
           [,writable=on|off][,multi-conn=on|off|auto][,allocation-depth=on|off]
           [,bitmaps.0=<bitmap>,bitmaps.1=<bitmap>...]
           [,iothread=<id> | ,iothread.0=<id>,iothread.1=<id>...]
                            export a node over NBD (each bitmap as qemu:dirty-bitmap:<name>)
  --export type=fuse,id=<id>,node-name=<name>,mountpoint=<file>[,writable=on|off][,growable=on|off]
           [,allow-other=on|off|auto][,io-uring=on|off|auto][,iothread=<id> | ,iothread.0=<id>...]
                            export a node as a regular file (FUSE)
  --export type=vhost-user-blk,id=<id>,node-name=<name>,addr.type=unix,addr.path=<path>
           [,writable=on|off][,num-queues=<n>][,logical-block-size=<n>][,iothread=<id> | ,iothread.0=<id>...]
                            export a node to a virtual machine (vhost-user-blk)
  --chardev socket,id=<id>,path=<path>,server=on,wait=off
  --monitor chardev=<id>    a QMP monitor on that socket (created 0600)
  --pidfile <path>          write the process id once everything is ready
  --daemonize               detach once everything is ready (the parent exits 0 then)
";

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
                match object_help(&v) {
                    Some(text) => cl.object_help = Some(text?),
                    None => cl.items.push(Item::Object(v)),
                }
            }
            "--blockdev" => cl.items.push(Item::Blockdev(value.expect("value"))),
            "--nbd-server" => cl.items.push(Item::NbdServer(value.expect("value"))),
            "--export" => cl.items.push(Item::Export(value.expect("value"))),
            "--pidfile" => cl.pidfile = Some(PathBuf::from(value.expect("value"))),
            "--chardev" => cl.items.push(Item::Chardev(value.expect("value"))),
            "--monitor" => cl.items.push(Item::Monitor(value.expect("value"))),
            "--daemonize" => cl.daemonize = true,
            other => {
                return Err(format!(
                    "unrecognized option '{other}' (supported: --object, --blockdev, --nbd-server, --export, \
                     --chardev, --monitor, --pidfile, --daemonize, --help, --version)"
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
        let types = parse(&args(&["--object", "help"]))
            .unwrap()
            .object_help
            .unwrap();
        assert!(
            types.contains("tls-creds-x509") && types.contains("iothread"),
            "{types}"
        );
        let x509 = parse(&args(&["--object", "tls-creds-x509,help"]))
            .unwrap()
            .object_help
            .unwrap();
        assert!(
            x509.contains("verify-peer") && !x509.contains("poll-max-ns"),
            "{x509}"
        );
        assert!(parse(&args(&["--object", "nope,help"]))
            .unwrap_err()
            .contains("unknown object type 'nope'"));
    }
}
