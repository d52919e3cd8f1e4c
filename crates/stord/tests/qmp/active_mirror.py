"""A mirror switched to copy-mode=write-blocking with block-job-change, the same flow
against qsd and stord: the mirror crawls (speed 1) so its background copy leaves the
upper half of the target alone; once write-blocking, writes through the NBD export reach
the target before they complete: whole granules at once, a granule's part only where the
granule was in step already (a part of a dirty granule waits for the background copy,
as QEMU's active mirror does). After a forced cancel, the upper half of the two targets
is byte for byte the same, and holds what was written there.

Every return, error and event (block-job-change's refusals; query-block-jobs with
actively-synced) equal to qsd's."""

import os
import time

import common
import stream
from common import ok, run

SIZE = 32 << 20
HALF = 16 << 20



def flow(binary, tag, base):
    src, tgt = common.path(f"am-{tag}-src.qcow2"), common.path(f"am-{tag}-tgt.qcow2")
    run("cp", base, src)
    common.qcow2(tgt, SIZE)
    sock = common.path(f"am-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=sf,filename={src}",
        "--blockdev", "driver=qcow2,node-name=src,file=sf",
        "--blockdev", f"driver=file,node-name=tf,filename={tgt}",
        "--blockdev", "driver=qcow2,node-name=tgt,file=tf",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=src,name=live,writable=on",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    try:
        q = d.qmp()

        def c(cmd, **a):
            out.append((cmd, a, stream.clean(q.cmd_raw(cmd, a))))

        def jobs():
            js = ok(q.cmd_raw("query-block-jobs"))
            out.append(("jobs", [stream.clean({k: v for k, v in j.items() if k != "len"})
                                 for j in js]))

        change = lambda mode, id="m", ty="mirror": c(
            "block-job-change", id=id, type=ty, **{"copy-mode": mode})
        change("write-blocking", id="nope")
        c("blockdev-mirror", **{"job-id": "m"}, device="src", target="tgt", sync="full",
          speed=1)
        time.sleep(0.3)
        jobs()
        change("background")
        change("write-blocking")
        change("write-blocking")
        change("background")
        jobs()
        run("qemu-io", "-f", "raw", "-c", "write -P 0x55 20M 64k",
            "-c", "write -P 0x66 24580k 4k", "-c", "write -P 0x77 31000k 192k",
            "-c", "write -z 28M 128k", "-c", "write -P 0x88 22M 1M", live)
        c("block-job-cancel", device="m", force=True)
        stream.wait_status(q, "m", "gone")
        out.append(("events", stream.job_events(q)))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", tgt)
    raw = common.path(f"am-{tag}-tgt.raw")
    run("qemu-img", "convert", "-O", "raw", tgt, raw)
    with open(raw, "rb") as f:
        f.seek(HALF)
        upper = f.read(SIZE - HALF)
    return out, upper


def test():
    base = common.path("am-base.qcow2")
    common.qcow2(base, SIZE)
    run("qemu-io", "-c", f"write -P 0x11 0 {SIZE}", base)
    theirs, t_upper = flow("qemu-storage-daemon", "qsd", base)
    ours, o_upper = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    at = lambda o, n: o_upper[o - HALF:o - HALF + n]
    assert at(20 << 20, 64 << 10) == b"\x55" * (64 << 10)
    assert at(22 << 20, 1 << 20) == b"\x88" * (1 << 20)
    assert at(28 << 20, 128 << 10) == b"\0" * (128 << 10)
    # The 4k inside a granule the background copy had not reached stays for it.
    assert at(24580 << 10, 4096) == b"\0" * 4096
    for i in range(0, len(t_upper), 65536):
        assert t_upper[i:i + 65536] == o_upper[i:i + 65536], \
            f"targets differ at {HALF + i:#x}"


if __name__ == "__main__":
    common.main(test)
