//! The daemons' command lines: the binary and IoThread of each daemon name, the block
//! node of each backend, and an export of the node "disk" over NBD, vhost-user-blk or
//! FUSE, in qemu-storage-daemon's option syntax (stord takes the same); nbdkit's for NBD.

use std::path::{Path, PathBuf};

use crate::media::{qcow2_image, Paths, IMAGE_SIZE};
use crate::peers::{stord_binary, which};

/// `--blockdev` for `backend`: null, `file-<aio mode>` with O_DIRECT, or `dev` (a block
/// device, `img` being its path: the fast-device medium of [`crate::media::FastDev`]).
pub fn blockdev(backend: &str, img: &Path) -> String {
    if backend == "dev" {
        return format!(
            "driver=host_device,node-name=disk,filename={},aio=io_uring,cache.direct=on",
            img.display()
        );
    }
    if let Some(kind) = backend.strip_prefix("qcow2-") {
        return format!(
            "driver=qcow2,node-name=disk,file.driver=file,file.filename={},file.aio=io_uring,\
             file.cache.direct=on",
            qcow2_image(img, kind).display()
        );
    }
    match backend.strip_prefix("file-") {
        None => format!("driver=null-co,node-name=disk,size={IMAGE_SIZE},read-zeroes=on"),
        Some(aio) => format!(
            "driver=file,node-name=disk,filename={},aio={aio},cache.direct=on",
            img.display()
        ),
    }
}

/// The binary and the `--object iothread` of a stord-POLICY, base-POLICY, qsd or qsd-poll0
/// daemon. `base-POLICY` is an earlier stord build, named by `STORD_BENCH_BASELINE`, so a
/// change can be measured before and after in one run.
pub fn qsd_style(daemon: &str) -> (PathBuf, String) {
    if let Some(policy) = daemon.strip_prefix("base-") {
        let bin = std::env::var_os("STORD_BENCH_BASELINE")
            .map(PathBuf::from)
            .expect("base-POLICY needs STORD_BENCH_BASELINE=<an earlier stord binary>");
        return (bin, format!("iothread,id=io0,poll-policy={policy}"));
    }
    match daemon.strip_prefix("stord-") {
        // stord-POLICY, stord-POLICY:MAXNS for another poll-max-ns, and any more IoThread
        // options after '+' (stord-classic+poll-yield-ns=0).
        Some(spec) => {
            let mut parts = spec.split('+');
            let head = parts.next().unwrap_or(spec);
            let (policy, max) = match head.split_once(':') {
                Some((p, m)) => (p, format!(",poll-max-ns={m}")),
                None => (head, String::new()),
            };
            let extra: String = parts.map(|o| format!(",{o}")).collect();
            (
                stord_binary(),
                format!("iothread,id=io0,poll-policy={policy}{max}{extra}"),
            )
        }
        None => {
            let bin = which("qemu-storage-daemon");
            match daemon {
                "qsd" => (bin, "iothread,id=io0".into()),
                "qsd-poll0" => (bin, "iothread,id=io0,poll-max-ns=0".into()),
                other => panic!("unknown daemon {other}"),
            }
        }
    }
}

/// Arguments that serve `backend` over NBD on `sock` (export name "disk"), and the URI.
pub fn nbd_args(daemon: &str, backend: &str, p: &Paths) -> (PathBuf, Vec<String>, String) {
    if daemon == "nbdkit" {
        let mut args = vec!["-f".to_string(), "-U".into(), p.sock.display().to_string()];
        match backend {
            "null" => args.extend(["null".into(), "1G".into()]),
            _ => args.extend([
                "file".into(),
                p.img.display().to_string(),
                "cache=none".into(),
            ]),
        }
        let uri = format!("nbd+unix:///?socket={}", p.sock.display());
        return (which("nbdkit"), args, uri);
    }
    let (bin, iothread) = qsd_style(daemon);
    let args = vec![
        "--object".into(),
        iothread,
        "--blockdev".into(),
        blockdev(backend, &p.img),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", p.sock.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0".into(),
    ];
    let uri = format!("nbd+unix:///disk?socket={}", p.sock.display());
    (bin, args, uri)
}

/// qsd-style arguments: IoThread `io0` from `iothread`, the node "disk" from `node`, and a
/// writable one-queue vhost-user-blk export on `sock` served by io0.
pub(crate) fn vhost_args(iothread: String, node: String, sock: &Path) -> Vec<String> {
    vhost_args_mq(iothread, node, sock, 1, 1)
}

/// As [`vhost_args`] with `queues` queues served by `iothreads` IoThreads io0..ioN-1 (the
/// same options as io0; queue i on IoThread i % N); one IoThread means `iothread=io0`.
pub(crate) fn vhost_args_mq(
    iothread: String,
    node: String,
    sock: &Path,
    queues: usize,
    iothreads: usize,
) -> Vec<String> {
    let mut args = vec!["--object".into(), iothread.clone()];
    let mut placement = "iothread=io0".to_string();
    if iothreads > 1 {
        placement = "iothread.0=io0".into();
        for i in 1..iothreads {
            args.push("--object".into());
            args.push(iothread.replacen("id=io0", &format!("id=io{i}"), 1));
            placement.push_str(&format!(",iothread.{i}=io{i}"));
        }
    }
    args.extend([
        "--blockdev".into(),
        node,
        "--export".into(),
        format!(
            "type=vhost-user-blk,id=vu0,node-name=disk,addr.type=unix,addr.path={},writable=on,num-queues={queues},{placement}",
            sock.display()
        ),
    ]);
    args
}

/// qsd-style arguments: an `--object` for each of `iothreads` (ids io0, io1, ...), the
/// block node `node` (named "disk") and a writable FUSE export on `mnt` with one queue per
/// IoThread, over FUSE-over-io_uring with `io_uring`.
pub(crate) fn fuse_args(
    iothreads: Vec<String>,
    node: String,
    mnt: &Path,
    io_uring: bool,
) -> Vec<String> {
    let threads = iothreads.len();
    let mut args: Vec<String> = Vec::new();
    for obj in iothreads {
        args.push("--object".into());
        args.push(obj);
    }
    args.push("--blockdev".into());
    args.push(node);
    let mut export = format!(
        "type=fuse,id=f0,node-name=disk,mountpoint={},writable=on",
        mnt.display()
    );
    if threads == 1 {
        export.push_str(",iothread=io0");
    } else {
        for i in 0..threads {
            export.push_str(&format!(",iothread.{i}=io{i}"));
        }
    }
    if io_uring {
        export.push_str(",io-uring=on");
    }
    args.push("--export".into());
    args.push(export);
    args
}
