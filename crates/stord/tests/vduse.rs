//! The vduse-blk export in a guest whose kernel has VDUSE: QEMU (TCG) boots Debian's 6.12
//! kernel with an initramfs that carries stord, qemu-storage-daemon, iproute2's `vdpa` and
//! util-linux's `blkdiscard` (scripts/build-guest.sh). The daemon runs inside the guest and
//! serves a null and a file node as VDUSE devices; tests/guest/vduse.sh attaches them and
//! checks reads, writes, flush, discard, write-zeroes, a daemon killed and restarted (it
//! takes the devices over), and an export removed while its device is open. The same
//! script runs against qsd, and each step must come out the same.

mod common;

use std::process::Command;
use std::time::Duration;

/// Builds the kernel and an initramfs carrying the daemons and tools.
fn build_guest() {
    let which = |p: &str| {
        let out = Command::new("sh")
            .args(["-c", &format!("command -v {p}")])
            .output()
            .expect("sh");
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(!path.is_empty(), "{p} is not installed");
        path
    };
    common::guest::build(&[
        "vduse",
        env!("CARGO_BIN_EXE_stord"),
        &which("qemu-storage-daemon"),
        &which("vdpa"),
        "/usr/sbin/blkdiscard",
    ]);
}

/// Boots the guest with `daemon` and returns its console output.
fn boot(daemon: &str) -> String {
    let machine: Vec<String> = ["-machine", "q35", "-smp", "2", "-m", "512"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    common::guest::boot(
        &machine,
        "initrd-vduse",
        &format!("stord.script=vduse stord.daemon={daemon}"),
        Duration::from_secs(300),
        |_| {},
    )
}

/// The guest's `GUEST-<key> value` lines, in order, without the start and end markers.
fn steps(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.find("GUEST-").map(|i| l[i..].trim().to_string()))
        .filter(|l| !l.starts_with("GUEST-START") && !l.starts_with("GUEST-END"))
        .collect()
}

fn field<'a>(steps: &'a [String], key: &str) -> Option<&'a str> {
    let tag = format!("GUEST-{key} ");
    steps
        .iter()
        .find_map(|l| l.strip_prefix(&tag))
        .map(str::trim)
}

#[test]
fn vduse_blk_serves_a_guest_kernel_as_qsd_does() {
    build_guest();
    let stord = boot("stord");
    let s = steps(&stord);
    let expect = [
        ("CREATED", "control vd0 vd1"),
        ("NULL", "131072 ro=1"),
        ("NULL-READ", "zeroes"),
        ("NULL-WRITE", "refused"),
        ("FILE", "131072 ro=0 queues=2"),
        ("READBACK", "same"),
        ("IN-FILE", "same"),
        ("DISCARDED", "zeroes"),
        ("ZEROED", "zeroes"),
        ("RECONNECTED", "same"),
        ("WRITER", "done"),
        ("REPLAYED", "same"),
        ("EXPORT-DELETED", "e1"),
        ("OTHER-SERVED", "zeroes"),
        ("DETACHED", "vdb"),
        ("DETACHED-SERVED", "vd0"),
        ("EXIT", "0"),
        ("STDERR", "0"),
    ];
    for (key, want) in expect {
        assert_eq!(field(&s, key), Some(want), "stord, step {key}:\n{stord}");
    }
    assert!(s.iter().any(|l| l == "GUEST-PASS"), "stord:\n{stord}");
    // Both devices offer discard and write-zeroes (their limits are each daemon's own).
    let limits = field(&s, "LIMITS").unwrap_or_default();
    assert!(
        !limits.contains("=0 ") && !limits.ends_with("=0"),
        "stord: {limits}"
    );

    let qsd = boot("qemu-storage-daemon");
    let q = steps(&qsd);
    // Limits are each daemon's own; whether the kill caught the writer is timing.
    let same = |l: &&String| !l.starts_with("GUEST-LIMITS") && !l.starts_with("GUEST-INFO");
    let (s, q): (Vec<&String>, Vec<&String>) = (
        s.iter().filter(same).collect(),
        q.iter().filter(same).collect(),
    );
    // Every step up to the export removed while open must be qsd's. The teardown after it
    // (detaching a served device, SIGTERM) once hung in qsd 10.0 under CI load: there
    // stord's own values above are the check, and a qsd that differs is reported.
    let cut = |v: &[&String]| {
        v.iter()
            .position(|l| l.starts_with("GUEST-DETACHED "))
            .map_or(v.len(), |i| i + 1)
    };
    let (sc, qc) = (cut(&s), cut(&q));
    assert_eq!(
        s[..sc],
        q[..qc],
        "stord and qsd differ:\n--- stord\n{stord}\n--- qsd\n{qsd}"
    );
    if s[sc..] != q[qc..] {
        eprintln!("qsd's teardown differs from stord's (not held against stord):\n{qsd}");
    }
}
