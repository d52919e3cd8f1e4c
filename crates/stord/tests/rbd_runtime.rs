//! The rbd driver's libraries are loaded at run time: stord links neither librbd nor
//! librados, and where they cannot be loaded only `driver=rbd` fails (with an error that
//! names the package), while every other node serves. The libraries are hidden from the
//! daemon in a mount namespace of its own (bound over by /dev/null), so the test means
//! the same on a machine with Ceph's packages (CI's) as on one without.

mod common;

use common::rawqmp::{monitor_args, RawQmp};
use common::{run, run_ok, sparse_image, tmpdir, Stord};

const CEPH_LIBRARIES: [&str; 2] = ["librbd", "librados"];

#[test]
fn the_binary_links_no_ceph_library() {
    let deps = run_ok("ldd", &[env!("CARGO_BIN_EXE_stord")]);
    for lib in CEPH_LIBRARIES {
        assert!(!deps.contains(lib), "stord links {lib}:\n{deps}");
    }
}

/// Runs the rest of its command line with librbd.so.1 and librados.so.2 unloadable:
/// every path the dynamic loader would find them at is bound over by /dev/null.
const HIDE_CEPH: &str = r#"
for f in $(ldconfig -p | awk '/(librbd\.so\.1|librados\.so\.2) /{print $NF}'); do
    mount --bind /dev/null "$f" || exit 1
done
exec "$0" "$@""#;

#[test]
fn rbd_without_its_libraries_fails_clearly_while_a_file_node_serves() {
    let dir = tmpdir("rbd-runtime");
    let img = dir.join("disk.img");
    sparse_image(&img, 8 << 20);
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x3c 0 1M",
            img.to_str().unwrap(),
        ],
    );
    let qmp = dir.join("qmp.sock");
    let sock = dir.join("nbd.sock");
    let mut args = monitor_args(&qmp);
    args.extend([
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", img.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", sock.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on".into(),
    ]);
    let wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        HIDE_CEPH,
    ];
    let mut stord = Stord::start_wrapped(&dir, &wrapper, &args);
    let mut q = RawQmp::connect(&qmp);

    let r = q.send(
        r#"{"execute":"blockdev-add","arguments":{"driver":"rbd","node-name":"r","pool":"rbd","image":"i","server":[{"host":"127.0.0.1","port":"6789"}]}}"#,
    );
    assert_eq!(r["error"]["class"], "GenericError", "{r}");
    let desc = r["error"]["desc"].as_str().unwrap();
    assert!(
        desc.starts_with("rbd: cannot load librados.so.2 (install Debian's librbd1 package): "),
        "{desc}"
    );
    // blockdev-create of an rbd image loads the same way and fails the job the same way.
    let r = q.send(
        r#"{"execute":"blockdev-create","arguments":{"job-id":"c","options":{"driver":"rbd","location":{"pool":"rbd","image":"i"},"size":1048576}}}"#,
    );
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    q.wait_event("JOB_STATUS_CHANGE", "status", "concluded");
    let jobs = q.send(r#"{"execute":"query-jobs"}"#);
    let err = jobs["return"][0]["error"].as_str().unwrap_or_default();
    assert!(err.contains("install Debian's librbd1 package"), "{jobs}");

    // The file node next to it serves reads and writes.
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    run_ok("qemu-io", &["-f", "raw", "-c", "read -P 0x3c 0 1M", &uri]);
    run_ok(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x77 1M 64k", &uri],
    );
    let out = run("qemu-io", &["-f", "raw", "-c", "read -P 0x77 1M 64k", &uri]);
    assert!(out.status.success());
    let r = q.send(r#"{"execute":"query-named-block-nodes"}"#);
    let names: Vec<&str> = r["return"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["node-name"].as_str())
        .collect();
    assert_eq!(names, ["disk"], "{r}");
    stord.signal(libc::SIGTERM);
    assert!(stord
        .wait_exit(std::time::Duration::from_secs(10))
        .success());
}
