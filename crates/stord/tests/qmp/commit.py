"""block-commit of intermediate images, the same flow against qsd and stord over a chain
base <- s1 <- s2 <- top whose top an NBD export serves throughout: QEMU's errors, then s1
and s2 committed into base slowly, paused and resumed while the guest writes to top and
fio verify runs, then a cancelled commit. Every return, the job events in order and the job
lists equal qsd's; afterwards top names base as its backing file, qemu-img check is
clean, top reads as before plus the guest's writes, and the images are qemu-img
compare-identical to qsd's. The active layer's commit is mirror.py's."""

import os
import subprocess
import threading
import time

import common
from stream import clean, job_events, qemu_io, wait_status, fio_verify

SIZE = 32 << 20
NAMES = ("base", "s1", "s2", "top")


def img(tag, name):
    return common.path(f"cm-{tag}-{name}.qcow2")


def make_chain(tag):
    prev = None
    for n in NAMES:
        p = img(tag, n)
        if os.path.exists(p):
            os.unlink(p)
        args = ["qemu-img", "create", "-q", "-f", "qcow2", p, str(SIZE)]
        if prev:
            args[5:5] = ["-b", os.path.basename(prev), "-F", "qcow2"]
        subprocess.run(args, check=True)
        prev = p
    qemu_io(img(tag, "base"), "write -P 0x11 0 8M", "write -P 0x12 24M 1M")
    qemu_io(img(tag, "s1"), "write -P 0x21 1M 2M", "write -z 4M 1M", "write -P 0x22 20M 3M")
    qemu_io(img(tag, "s2"), "write -P 0x31 2M 64k", "write -P 0x32 21M 512k",
            "write -P 0x33 30M 2M")
    qemu_io(img(tag, "top"), "write -P 0x41 0 64k", "write -P 0x42 31M 4k")


def flow(binary, tag):
    make_chain(tag)
    before = common.path(f"cm-{tag}-before.raw")
    subprocess.run(["qemu-img", "convert", "-O", "raw", img(tag, "top"), before], check=True)
    sock = common.path(f"cm-{tag}.sock")
    args = []
    prev = None
    for n in NAMES:
        args += ["--blockdev", f"driver=file,node-name={n}-file,filename={img(tag, n)}"]
        backing = f",backing={prev}" if prev else ""
        args += ["--blockdev", f"driver=qcow2,node-name={n},file={n}-file{backing}"]
        prev = n
    args += ["--nbd-server", f"addr.type=unix,addr.path={sock}",
             "--export", "type=nbd,id=e,node-name=top,name=top,writable=on"]
    d = common.Daemon(args, binary=binary, tag=tag)
    out = []
    try:
        q = d.qmp()

        def c(name, **a):
            r = q.cmd_raw(name, a)
            out.append((name, a, r))
            return r

        c("block-commit", device="nope")
        c("block-commit", device="s2", **{"job-id": "c"})
        c("block-commit", device="top", top="x", **{"top-node": "s2", "job-id": "c"})
        c("block-commit", device="top", base="x", **{"base-node": "s1", "job-id": "c"})
        c("block-commit", device="top", **{"top-node": "nope", "job-id": "c"})
        c("block-commit", device="top", **{"top-node": "s2", "base-node": "top",
                                          "job-id": "c"})
        c("block-commit", device="top", **{"top-node": "s2", "base-node": "s2",
                                          "job-id": "c"})
        c("block-commit", device="top", **{"top-node": "s2", "base": "nothing",
                                          "job-id": "c"})
        c("block-commit", device="top", speed=-1, **{"top-node": "s2", "job-id": "c"})
        c("block-commit", device="top", **{"top-node": "s2", "job-id": "c 1"})

        # s2 and s1 into base, slowly, while the guest writes to top.
        c("block-commit", device="top", speed=1 << 20, **{
            "job-id": "c1", "top-node": "s2", "base-node": "base",
            "auto-finalize": False})
        c("block-commit", device="top", **{"top-node": "s1", "job-id": "c2"})
        c("blockdev-del", **{"node-name": "s1"})
        c("job-pause", id="c1")
        wait_status(q, "c1", "paused")
        out.append(("paused", clean(q.cmd_raw("query-block-jobs"))))
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x51 2M 64k",
                "write -P 0x52 21M 4k", fmt="raw")
        c("job-resume", id="c1")
        fio_out = {}
        t = threading.Thread(target=lambda: fio_out.update(r=fio_verify(sock)))
        t.start()
        time.sleep(0.3)
        c("block-job-set-speed", device="c1", speed=0)
        t.join()
        assert fio_out["r"]["jobs"][0]["error"] == 0, fio_out
        wait_status(q, "c1", "pending")
        out.append(("pending", clean(q.cmd_raw("query-jobs"))))
        c("job-finalize", id="c1")
        wait_status(q, "c1", "gone")
        out.append(("events c1", job_events(q)))
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x43 8M 4M", fmt="raw")
        for n in ("s2", "s1"):
            c("blockdev-del", **{"node-name": n})
            c("blockdev-del", **{"node-name": f"{n}-file"})
        c("query-block-jobs")
        q.close()
    finally:
        d.stop()
    return out


def test():
    theirs = flow("qemu-storage-daemon", "qsd")
    ours = flow(common.STORD, "stord")
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    for a, b in zip(theirs, ours):
        a, b = clean(a), clean(b)
        assert a == b, f"\nqsd   {a}\nstord {b}"
    for tag in ("qsd", "stord"):
        for n in ("base", "top"):
            r = subprocess.run(["qemu-img", "check", img(tag, n)], capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run(["qemu-img", "info", "--output=json", img(tag, "top")],
                           capture_output=True, text=True, check=True)
        assert f'"backing-filename": "{img(tag, "base")}"' in r.stdout, r.stdout
    for n in ("base", "top"):
        r = subprocess.run(["qemu-img", "compare", img("qsd", n), img("stord", n)],
                           capture_output=True, text=True)
        assert r.returncode == 0, (n, r.stdout + r.stderr)


if __name__ == "__main__":
    common.main(test)
