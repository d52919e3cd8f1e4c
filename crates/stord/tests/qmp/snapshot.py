"""External snapshots, the same flow against qsd and stord while an NBD export of the
active layer serves a guest (fio verify writes and reads back across each change):

blockdev-snapshot-sync of base (the overlay made by the daemon, naming base as its
backing file; base goes read-only, the export moves to the overlay), blockdev-snapshot of
that overlay onto one made by qemu-img and opened by blockdev-add, a block-stream that folds
the middle image into the top, then the active commit of the top into base (READY, job-complete, the export back on
base). QEMU's errors first. Every return, the job events in order and the node list equal
qsd's, and so do two transactions (a snapshot taken back by an abort action; a snapshot
and a bitmap on the new overlay). Afterwards qemu-img check is clean, `qemu-img info --backing-chain` has the same
shape, and the images are qemu-img compare-identical to qsd's."""

import json
import os
import subprocess
import threading
import time

import common
from mirror import create, fio_verify, job_events, served
from stream import clean, qemu_io, wait_status

SIZE = 32 << 20


def img(tag, name):
    return common.path(f"sn-{tag}-{name}.qcow2")


def nodes(q):
    """Which node backs onto which, and read-only flags."""
    out = []
    for n in q.cmd_raw("query-named-block-nodes")["return"]:
        if n["node-name"].startswith("#") or n["drv"] == "file":
            continue
        out.append((n["node-name"], n["ro"], n.get("backing_file_depth")))
    return sorted(out)


def flow(binary, tag):
    for n in ("base", "ov1", "ov2", "ov3", "fin", "hasb", "hb"):
        if os.path.exists(img(tag, n)):
            os.unlink(img(tag, n))
    create(img(tag, "base"))
    qemu_io(img(tag, "base"), "write -P 0x11 0 4M", "write -P 0x12 20M 1M")
    # ov1 does not exist yet (the daemon makes it): -u.
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b",
                    os.path.basename(img(tag, "ov1")), "-F", "qcow2", img(tag, "ov2"),
                    str(SIZE)], check=True)
    create(img(tag, "hb"))
    create(img(tag, "hasb"), img(tag, "hb"))
    sock = common.path(f"sn-{tag}.sock")
    args = ["--blockdev", f"driver=file,node-name=base-file,filename={img(tag, 'base')}",
            "--blockdev", "driver=qcow2,node-name=base,file=base-file",
            "--blockdev", f"driver=file,node-name=ov2-file,filename={img(tag, 'ov2')}",
            "--blockdev", "driver=qcow2,node-name=ov2,file=ov2-file,backing=",
            "--blockdev", f"driver=file,node-name=hasb-file,filename={img(tag, 'hasb')}",
            "--blockdev", "driver=qcow2,node-name=hasb,file=hasb-file",
            "--nbd-server", f"addr.type=unix,addr.path={sock}",
            "--export", "type=nbd,id=e,node-name=base,name=top,writable=on"]
    d = common.Daemon(args, binary=binary, tag=tag)
    out = []
    try:
        q = d.qmp()

        def c(name, **a):
            r = q.cmd_raw(name, a)
            out.append((name, a, clean(r)))
            return r

        c("blockdev-snapshot", node="nope", overlay="ov2")
        c("blockdev-snapshot", node="base", overlay="nope")
        c("blockdev-snapshot", node="base", overlay="hasb")
        c("blockdev-snapshot", node="base", overlay="ov2-file")
        ov1 = img(tag, "ov1")
        c("blockdev-snapshot-sync", **{"node-name": "nope", "snapshot-file": ov1,
                                       "snapshot-node-name": "ov1"})
        c("blockdev-snapshot-sync", **{"node-name": "base", "snapshot-file": ov1})
        c("blockdev-snapshot-sync", **{"node-name": "base", "snapshot-file": ov1,
                                       "snapshot-node-name": "ov2"})
        c("blockdev-snapshot-sync", **{"node-name": "base", "snapshot-file": ov1,
                                       "snapshot-node-name": "ov1", "mode": "bogus"})
        c("blockdev-del", **{"node-name": "hasb"})
        c("blockdev-del", **{"node-name": "hasb-file"})

        fio_out = {}
        t = threading.Thread(target=lambda: fio_out.update(r=fio_verify(sock, "top", "8M")))
        t.start()
        time.sleep(0.2)
        c("blockdev-snapshot-sync", **{"node-name": "base", "snapshot-file": ov1,
                                       "snapshot-node-name": "ov1"})
        out.append(("after sync", nodes(q)))
        out.append(("exports sync", served(q)))
        time.sleep(0.2)
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x21 1M 64k", fmt="raw")
        c("blockdev-snapshot", node="ov1", overlay="ov2")
        out.append(("after snapshot", nodes(q)))
        out.append(("exports", served(q)))
        c("blockdev-snapshot", node="ov1", overlay="ov2")
        t.join()
        assert fio_out["r"]["jobs"][0]["error"] == 0, fio_out
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x31 2M 64k", fmt="raw")

        # A transaction is all or nothing: a snapshot before an abort is taken back.
        c("transaction", actions=[
            {"type": "blockdev-snapshot-sync",
             "data": {"node-name": "ov2", "snapshot-file": img(tag, "ov3"),
                      "snapshot-node-name": "ov3"}},
            {"type": "abort", "data": {}}])
        out.append(("after abort", nodes(q)))
        out.append(("exports abort", served(q)))

        # Snapshot, then stream: ov1 folds into ov2, which then backs onto base.
        c("block-stream", device="ov2", **{"base-node": "base", "job-id": "s"})
        wait_status(q, "s", "gone")
        out.append(("events s", job_events(q)))
        c("blockdev-del", **{"node-name": "ov1"})

        # Then the active commit back into base, fio verify writing across the pivot.
        t = threading.Thread(target=lambda: fio_out.update(r=fio_verify(sock, "top", "8M")))
        t.start()
        time.sleep(0.2)
        c("block-commit", device="ov2", **{"job-id": "c"})
        common.wait_event(q, "BLOCK_JOB_READY", timeout=30)
        c("job-complete", id="c")
        wait_status(q, "c", "gone")
        t.join()
        assert fio_out["r"]["jobs"][0]["error"] == 0, fio_out
        out.append(("events c", job_events(q)))
        out.append(("after commit", nodes(q)))
        out.append(("exports commit", served(q)))
        # fio's verify headers carry timestamps: overwrite what it wrote.
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x41 8M 4M", fmt="raw")
        # ov2 still backs onto base: it goes, then a snapshot and a bitmap on the new
        # overlay in one transaction.
        c("blockdev-del", **{"node-name": "ov2"})
        c("blockdev-del", **{"node-name": "ov2-file"})
        c("transaction", actions=[
            {"type": "blockdev-snapshot-sync",
             "data": {"node-name": "base", "snapshot-file": img(tag, "fin"),
                      "snapshot-node-name": "fin"}},
            {"type": "block-dirty-bitmap-add", "data": {"node": "fin", "name": "b0"}}])
        out.append(("after transaction", nodes(q)))
        out.append(("exports transaction", served(q)))
        qemu_io(f"nbd+unix:///top?socket={sock}", "write -P 0x51 0 64k", fmt="raw")
        out.append(("bitmap", q.cmd_raw("x-debug-block-dirty-bitmap-sha256",
                                         {"node": "fin", "name": "b0"})))
        q.close()
    finally:
        d.stop()
    return out


def chain_shape(tag):
    r = subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", "-U",
                        img(tag, "ov2")], capture_output=True, text=True, check=True)
    return [(os.path.basename(i["filename"]).replace(tag, "T"),
             os.path.basename(i.get("backing-filename", "")).replace(tag, "T"),
             i.get("backing-filename-format"))
            for i in json.loads(r.stdout)]


def test():
    theirs = flow("qemu-storage-daemon", "qsd")
    ours = flow(common.STORD, "stord")
    assert len(theirs) == len(ours), (len(theirs), len(ours), theirs, ours)
    for a, b in zip(theirs, ours):
        # The image names carry the daemon's tag (the test directory may too: leave it).
        a = json.dumps(a, sort_keys=True).replace("sn-qsd-", "sn-T-")
        b = json.dumps(b, sort_keys=True).replace("sn-stord-", "sn-T-")
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert chain_shape("qsd") == chain_shape("stord"), (chain_shape("qsd"),
                                                        chain_shape("stord"))
    for tag in ("qsd", "stord"):
        for n in ("base", "ov1", "ov2", "fin"):
            r = subprocess.run(["qemu-img", "check", img(tag, n)], capture_output=True,
                               text=True)
            assert r.returncode == 0, (tag, n, r.stdout + r.stderr)
    # base got every write in the end; ov2 what the guest wrote while it was on top,
    # ov1 what it wrote between the snapshots (fio's part of both depends on timing).
    for n in ("base", "fin"):
        r = subprocess.run(["qemu-img", "compare", img("qsd", n), img("stord", n)],
                           capture_output=True, text=True)
        assert r.returncode == 0, (n, r.stdout + r.stderr)


if __name__ == "__main__":
    common.main(test)
