"""Persistent dirty bitmaps in qcow2, the same flow against qsd and stord, each on its own
copy of one image that qemu-img gave two bitmaps and qemu-io wrote to:

- served read-write: the bitmaps are listed (persistent, recording as the image says) with
  the digests QEMU's writes left; `qemu-img info -U` sees them marked in use;
- writes through NBD, a new persistent bitmap, QEMU's refusals (a name the image has, a
  protocol node, a v2 image), disable, merge, clear, removal of a persistent bitmap (it
  leaves the image at once);
- after `quit`: `qemu-img info` lists the same bitmaps with the same flags, `qemu-img
  check` is clean, and served again the digests are the ones before the quit;
- qemu-img merges a bitmap stord wrote into another, stord reads the result;
- SIGKILL while serving: the bitmaps come back inconsistent, refused as QEMU refuses
  them, and can be removed; read-only opens refuse changes.

Every return, error text, dirty-bitmaps entry and digest equal between the two daemons;
the final images identical for qemu-img compare."""

import shutil
import signal
import subprocess

import common
from common import ok, run

SIZE = 64 << 20



def base_image():
    base = common.path("pbm-base.qcow2")
    run("qemu-img", "create", "-q", "-f", "qcow2", base, str(SIZE))
    run("qemu-img", "bitmap", "--add", base, "b0")
    run("qemu-img", "bitmap", "--add", "-g", "4096", "--disable", base, "b1")
    # qemu-io records its writes in the enabled bitmap b0.
    run("qemu-io", "-c", "write -P 0x11 0 64k", "-c", "write -P 0x12 5M 1M", base)
    run("qemu-img", "bitmap", "--enable", base, "b1")
    run("qemu-io", "-c", "write -P 0x13 9M 4k", base)
    v2 = common.path("pbm-v2.qcow2")
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", v2, str(SIZE))
    return base, v2


def info_bitmaps(img, share=False):
    import json
    args = ["qemu-img", "info", "--output=json"] + (["-U"] if share else []) + [img]
    out = json.loads(run(*args))
    return out.get("format-specific", {}).get("data", {}).get("bitmaps")


def flow(binary, tag, base, v2):
    img = common.path(f"pbm-{tag}.qcow2")
    shutil.copy(base, img)
    sock = common.path(f"pbm-{tag}.sock")
    uri = f"nbd+unix:///disk?socket={sock}"
    out = []

    def start(read_only=False):
        ro = ",read-only=on" if read_only else ""
        args = [
            "--blockdev", f"driver=file,node-name=f,filename={img}{ro}",
            "--blockdev", f"driver=qcow2,node-name=disk,file=f{ro}",
            "--blockdev", f"driver=file,node-name=f2,filename={v2}",
            "--blockdev", "driver=qcow2,node-name=old,file=f2",
        ]
        if not read_only:
            args += ["--nbd-server", f"addr.type=unix,addr.path={sock}",
                     "--export", "type=nbd,id=e,node-name=disk,name=disk,writable=on"]
        d = common.Daemon(args, binary=binary, tag=tag)
        return d, d.qmp()

    def write(*cmds):
        args = ["qemu-io", "-f", "raw"]
        for c in cmds:
            args += ["-c", c]
        run(*args, uri)

    def state(q, what):
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        disk = [n for n in nodes if n["node-name"] == "disk"][0]
        bitmaps = disk.get("dirty-bitmaps", [])
        out.append((what, "bitmaps", bitmaps))
        for b in bitmaps:
            out.append((what, b["name"], q.cmd_raw("x-debug-block-dirty-bitmap-sha256",
                                                   {"node": "disk", "name": b["name"]})))
        return bitmaps

    def quit(d, q):
        common.quit_and_wait(d, q)

    # Served read-write, written, bitmaps added, changed and removed.
    d, q = start()
    try:
        c = lambda cmd, **a: out.append((cmd, a, q.cmd_raw(cmd, a)))
        state(q, "opened")
        out.append(("in use", info_bitmaps(img, share=True)))
        write("write -P 0x21 1M 64k", "write -z 20M 1M", "discard 5M 64k")
        c("block-dirty-bitmap-add", node="disk", name="b2", persistent=True)
        c("block-dirty-bitmap-add", node="disk", name="b3", persistent=True,
          granularity=512, disabled=True)
        c("block-dirty-bitmap-add", node="disk", name="t", persistent=False)
        c("block-dirty-bitmap-add", node="disk", name="b0", persistent=True)
        c("block-dirty-bitmap-add", node="f", name="bx", persistent=True)
        c("block-dirty-bitmap-add", node="old", name="bx", persistent=True)
        write("write -P 0x22 30M 192k", "write -P 0x23 63M 1M")
        c("block-dirty-bitmap-disable", node="disk", name="b0")
        write("write -P 0x24 40M 4k")
        c("block-dirty-bitmap-merge", node="disk", target="b3", bitmaps=["b0", "t"])
        c("block-dirty-bitmap-clear", node="disk", name="t")
        c("block-dirty-bitmap-remove", node="disk", name="b1")
        before = state(q, "before quit")
        out.append(("b1 gone at once", info_bitmaps(img, share=True)))
        quit(d, q)
    finally:
        d.stop()
    out.append(("after quit", info_bitmaps(img)))
    check = subprocess.run(["qemu-img", "check", img], capture_output=True, text=True)
    assert check.returncode == 0 and "No errors" in check.stdout, check.stdout
    assert "leaked" not in check.stdout, check.stdout

    # Served again: the same bits. Then qemu-img merges one of ours into another.
    d, q = start()
    try:
        again = state(q, "reopened")
        key = lambda b: b["name"]
        assert sorted(again, key=key) == sorted(
            [b for b in before if b["name"] != "t"], key=key), (before, again)
        quit(d, q)
    finally:
        d.stop()
    run("qemu-img", "bitmap", "--merge", "b2", "--enable", img, "b0")
    d, q = start()
    try:
        state(q, "after qemu-img merge")
        # Killed while serving: the bitmaps stay marked in use, so they are inconsistent.
        write("write -P 0x31 2M 4k")
        q.close()
        d.proc.send_signal(signal.SIGKILL)
        d.wait()
    finally:
        d.stop()
    out.append(("after kill", info_bitmaps(img)))
    d, q = start()
    try:
        c = lambda cmd, **a: out.append((cmd, a, q.cmd_raw(cmd, a)))
        state(q, "inconsistent")
        c("block-dirty-bitmap-clear", node="disk", name="b0")
        c("block-dirty-bitmap-enable", node="disk", name="b2")
        c("block-dirty-bitmap-merge", node="disk", target="b2", bitmaps=["b3"])
        c("block_resize", node_name="disk", size=SIZE * 2)
        c("block-dirty-bitmap-remove", node="disk", name="b2")
        state(q, "b2 removed")
        quit(d, q)
    finally:
        d.stop()
    out.append(("after removal", info_bitmaps(img)))

    # Read-only: listed, not changeable.
    d, q = start(read_only=True)
    try:
        c = lambda cmd, **a: out.append((cmd, a, q.cmd_raw(cmd, a)))
        state(q, "read-only")
        c("block-dirty-bitmap-clear", node="disk", name="b3")
        c("block-dirty-bitmap-remove", node="disk", name="b3")
        c("block-dirty-bitmap-disable", node="disk", name="b3")
        quit(d, q)
    finally:
        d.stop()
    out.append(("after read-only", info_bitmaps(img)))
    check = subprocess.run(["qemu-img", "check", img], capture_output=True, text=True)
    out.append(("check", check.returncode))
    return out, img


def test():
    base, v2 = base_image()
    theirs, their_img = flow("qemu-storage-daemon", "qsd", base, v2)
    ours, our_img = flow(common.STORD, "stord", base, v2)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    run("qemu-img", "compare", their_img, our_img)


common.main(test)
