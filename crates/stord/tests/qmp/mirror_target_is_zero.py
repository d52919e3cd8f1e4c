"""blockdev-mirror's `target-is-zero` (QEMU 10.1): the caller says the target reads as
zeroes, so a `sync=full` mirror neither zeroes it first nor writes where the source reads
zeroes; a sparse target stays sparse. Checked against the schema text and QEMU's
documented behaviour (qsd 10.0 has no such argument: it refuses it), and side by side with
qsd for the mirror without it:

- qsd 10.0 refuses `target-is-zero` as an unexpected parameter; stord takes it;
- the same source (a qcow2 image with data, a zeroed range and a hole) mirrored to a sparse
  raw file opened with `discard=ignore`: without the argument qsd and stord both write the
  whole target (zeroes where the source has none: the target file is allocated through);
  with it, stord writes only the source's data: the target's allocation is the data's;
- both targets equal the source (`qemu-img compare`), and the job's events and ready
  length agree with qsd's for the mirror both run;
- writes during the job still land: data written over a known-zero range, then zeroes
  written over it again, read back as the source has them."""

import os
import subprocess

import common
from common import ok, run

SIZE = 64 << 20
DATA = [("0x61", 0, 1 << 20), ("0x62", 20 << 20, 3 << 20), ("0x63", 60 << 20, 1 << 20)]


def allocated(path):
    return os.stat(path).st_blocks * 512


def mirror(binary, tag, source, target_is_zero):
    target = common.path(f"mz-{tag}-{int(bool(target_is_zero))}.raw")
    run("qemu-img", "create", "-q", "-f", "raw", target, str(SIZE))
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=sf,filename={source}",
        "--blockdev", "driver=qcow2,node-name=src,file=sf",
        "--blockdev", f"driver=file,node-name=dst,filename={target}",
    ], binary=binary, tag=tag)
    out = []
    try:
        q = d.qmp()
        args = {"job-id": "m", "device": "src", "target": "dst", "sync": "full"}
        if target_is_zero is not None:
            args["target-is-zero"] = target_is_zero
        r = q.cmd_raw("blockdev-mirror", args)
        out.append(("blockdev-mirror", r))
        if "error" in r:
            q.close()
            return out, None
        ready = common.wait_event(q, "BLOCK_JOB_READY", timeout=60)
        out.append(("ready", ready["data"]["type"], ready["data"]["device"]))
        ok(q.cmd_raw("job-complete", {"id": "m"}))
        done = common.wait_event(q, "BLOCK_JOB_COMPLETED", timeout=60)
        out.append(("completed", done["data"]["len"] == done["data"]["offset"],
                    done["data"].get("error")))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "compare", "-f", "qcow2", "-F", "raw", source, target)
    return out, target


def test():
    source = common.path("mz-src.qcow2")
    run("qemu-img", "create", "-q", "-f", "qcow2", source, str(SIZE))
    cmds = []
    for pattern, off, n in DATA:
        cmds += ["-c", f"write -P {pattern} {off} {n}"]
    # A range written as zeroes (zero clusters: allocated, reading zeroes).
    cmds += ["-c", f"write -z {40 << 20} {4 << 20}"]
    run("qemu-io", "-f", "qcow2", *cmds, source)
    data = sum(n for _, _, n in DATA)

    # qsd 10.0 has no target-is-zero.
    theirs, _ = mirror("qemu-storage-daemon", "qsd", source, True)
    desc = theirs[0][1]["error"]["desc"]
    assert desc == "Parameter 'target-is-zero' is unexpected", theirs

    # Without it, both write the whole target.
    theirs, qsd_target = mirror("qemu-storage-daemon", "qsd", source, None)
    ours, stord_target = mirror(common.STORD, "stord", source, None)
    assert theirs == ours, f"\nqsd   {theirs}\nstord {ours}"
    assert allocated(qsd_target) >= SIZE // 2, allocated(qsd_target)
    assert allocated(stord_target) >= SIZE // 2, allocated(stord_target)

    # With it, stord writes the data and nothing else.
    ours, target = mirror(common.STORD, "stord", source, True)
    assert ours[0] == ("blockdev-mirror", {"return": {}}), ours
    assert ours[1:] == theirs[1:], ours
    assert data <= allocated(target) < data + (2 << 20), (allocated(target), data)
    # target-is-zero=false is the default.
    ours, target = mirror(common.STORD, "stord", source, False)
    assert allocated(target) >= SIZE // 2, allocated(target)

    active(source)


def active(source):
    """Writes while a target-is-zero mirror runs (write-blocking: they reach the target
    before they complete): data over a range the target knows as zeroes, then zeroes over
    it again; the pivoted target reads as the source."""
    target = common.path("mz-active.raw")
    run("qemu-img", "create", "-q", "-f", "raw", target, str(SIZE))
    sock = common.path("mz-active.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=sf,filename={source}",
        "--blockdev", "driver=qcow2,node-name=src,file=sf",
        "--blockdev", f"driver=file,node-name=dst,filename={target}",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=e,node-name=src,name=e,writable=on",
    ])
    try:
        q = d.qmp()
        ok(q.cmd_raw("blockdev-mirror", {"job-id": "m", "device": "src", "target": "dst",
                                         "sync": "full", "target-is-zero": True,
                                         "copy-mode": "write-blocking"}))
        common.wait_event(q, "BLOCK_JOB_READY", timeout=60)
        uri = f"nbd+unix:///e?socket={sock}"
        run("qemu-io", "-f", "raw", "-c", f"write -P 0x71 {30 << 20} 64k",
            "-c", f"write -z {30 << 20} 32k", "-c", f"write -P 0x72 {50 << 20} 4k", uri)
        ok(q.cmd_raw("job-complete", {"id": "m"}))
        common.wait_event(q, "BLOCK_JOB_COMPLETED", timeout=60)
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "compare", "-f", "qcow2", "-F", "raw", source, target)
    out = subprocess.run(["qemu-io", "-f", "raw", "-c", f"read -P 0 {30 << 20} 32k",
                          "-c", f"read -P 0x71 {(30 << 20) + (32 << 10)} 32k", target],
                         capture_output=True, text=True, check=True).stdout
    assert "Pattern verification failed" not in out, out


common.main(test)
