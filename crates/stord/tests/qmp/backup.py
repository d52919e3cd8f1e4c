"""blockdev-backup, the same flows against qsd and stord, a writable NBD export serving the
disk throughout:

- QEMU's refusals of bad arguments, in its order and words.
- Push backup: a transaction adds a bitmap and starts a full backup to a local qcow2,
  slowly, while the guest writes (qemu-io through the export): the target must hold the
  disk as it was at the start (copy-before-write). Then an incremental backup (sync=
  incremental with the bitmap) into a qcow2 backed by the full one: it holds the disk as
  it was at its start, and the bitmap afterwards holds only what was written since.
- Pull backup as libvirt runs it (fleecing): a scratch qcow2 backed by the disk, one
  transaction (new checkpoint bitmap, the old one disabled, blockdev-backup sync=none),
  the scratch exported read-only with the old checkpoint's bitmap; nbdinfo maps it;
  nbdcopy reads the point-in-time view while fio writes to the live export; the dirty
  extents copied onto the earlier full copy give the disk as it was at the checkpoint;
  block-job-cancel ends it and the scratch goes.

Every return, event and bitmap listing equal between the two; qemu-img check clean and
the backups qemu-img compare-identical to what the disk held at their points in time."""

import json
import os
import shutil
import threading
import time

import common
from common import ok, run
from stream import clean, job_events

SIZE = 64 << 20



def qcow2(path, backing=None, size=SIZE):
    common.qcow2(path, size, backing)


def wait_gone(q, job, out, timeout=60):
    """Events until `job` is gone (concluded and dismissed)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(j["id"] == job for j in ok(q.cmd_raw("query-jobs"))):
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"{job} did not end")
    out.append(("events", job_events(q)))


def bitmaps(q, node, out, what):
    nodes = ok(q.cmd_raw("query-named-block-nodes"))
    n = [x for x in nodes if x["node-name"] == node][0]
    out.append((what, n.get("dirty-bitmaps")))


def refusals(c):
    bb = lambda **a: c("blockdev-backup", **{"job-id": "j", "device": "disk", "target": "full",
                                              **a})
    bb(sync="incremental")
    bb(sync="bitmap")
    bb(sync="incremental", bitmap="b0", **{"bitmap-mode": "never"})
    bb(sync="full", bitmap="nope", **{"bitmap-mode": "on-success"})
    bb(sync="full", bitmap="b0")
    bb(sync="none", bitmap="b0", **{"bitmap-mode": "always"})
    bb(sync="full", bitmap="b0", **{"bitmap-mode": "never"})
    bb(sync="full", **{"bitmap-mode": "always"})
    bb(sync="sideways")
    bb(sync="full", device="nowhere")
    bb(sync="full", target="nowhere")
    bb(sync="full", target="disk")
    bb(sync="full", target="small")
    bb(sync="full", speed=-1)
    bb(sync="full", **{"x-perf": {"max-workers": 0}})
    bb(sync="full", **{"x-perf": {"max-chunk": 4096}})


def push(c, q, tag, sock, out):
    live = f"nbd+unix:///live?socket={sock}"
    t1 = common.path(f"bk-{tag}-t1.raw")
    run("nbdcopy", live, t1)
    act = lambda t, **d: {"type": t, "data": d}
    c("transaction", actions=[
        act("block-dirty-bitmap-add", node="disk", name="b0"),
        act("blockdev-backup", **{"job-id": "full", "device": "disk", "target": "full",
                                  "sync": "full", "speed": 8 << 20})])
    # Written while the backup runs: the backup keeps what was there before.
    run("qemu-io", "-f", "raw", "-c", "write -P 0x51 0 1M", "-c", "write -P 0x52 40M 64k",
        "-c", "write -z 60M 2M", "-c", "discard 8M 1M", "-c", "write -P 0x53 63M 4k", live)
    c("block-job-set-speed", device="full", speed=0)
    wait_gone(q, "full", out)
    bitmaps(q, "disk", out, "after the full backup")
    t2 = common.path(f"bk-{tag}-t2.raw")
    run("nbdcopy", live, t2)
    c("blockdev-add", driver="file", **{"node-name": "incf"},
      filename=common.path(f"bk-{tag}-inc.qcow2"))
    c("blockdev-add", driver="qcow2", **{"node-name": "inc"}, file="incf", backing="full")
    c("blockdev-backup", **{"job-id": "inc", "device": "disk", "target": "inc",
                            "sync": "incremental", "bitmap": "b0", "speed": 1 << 20})
    run("qemu-io", "-f", "raw", "-c", "write -P 0x61 40M 4k", "-c", "write -P 0x62 20M 64k",
        live)
    c("block-job-set-speed", device="inc", speed=0)
    wait_gone(q, "inc", out)
    bitmaps(q, "disk", out, "after the incremental backup")
    return t1, t2


def pull(c, q, tag, sock, out):
    live = f"nbd+unix:///live?socket={sock}"
    pit = f"nbd+unix:///pit?socket={sock}"
    act = lambda t, **d: {"type": t, "data": d}
    c("block-dirty-bitmap-add", node="disk", name="c1")
    t0 = common.path(f"bk-{tag}-t0.raw")
    run("nbdcopy", live, t0)
    run("qemu-io", "-f", "raw", "-c", "write -P 0x71 4M 128k", "-c", "write -P 0x72 33M 1M",
        "-c", "write -z 50M 64k", live)
    t3 = common.path(f"bk-{tag}-t3.raw")
    run("nbdcopy", live, t3)
    c("blockdev-add", driver="file", **{"node-name": "scf"},
      filename=common.path(f"bk-{tag}-scratch.qcow2"))
    c("blockdev-add", driver="qcow2", **{"node-name": "scratch"}, file="scf", backing="disk")
    c("transaction", actions=[
        act("block-dirty-bitmap-add", node="disk", name="c2"),
        act("block-dirty-bitmap-disable", node="disk", name="c1"),
        act("blockdev-backup", **{"job-id": "fleece", "device": "disk", "target": "scratch",
                                  "sync": "none"})])
    c("block-export-add", type="nbd", id="pit", **{"node-name": "scratch"}, name="pit",
      bitmaps=[{"node": "disk", "name": "c1"}])
    dirty = json.loads(run("nbdinfo", "--json", "--map=qemu:dirty-bitmap:c1", pit))
    out.append(("map", dirty))
    # The guest writes everywhere while the view is copied.
    writer = threading.Thread(target=lambda: common.fio(
        "--name=w", "--ioengine=nbd", f"--uri={live}", "--rw=randwrite", "--bs=64k",
        "--size=64M", "--io_size=32M", "--iodepth=8", "--verify=crc32c", "--do_verify=1"))
    writer.start()
    view = common.path(f"bk-{tag}-view.raw")
    run("nbdcopy", pit, view)
    writer.join()
    run("qemu-img", "compare", "-f", "raw", "-F", "raw", view, t3)
    # The incremental part onto the earlier full copy gives the checkpoint's content.
    common.apply_dirty(view, t0, dirty)
    run("qemu-img", "compare", "-f", "raw", "-F", "raw", t0, t3)
    c("block-export-del", id="pit")
    common.wait_event(q, "BLOCK_EXPORT_DELETED")
    jobs = ok(q.cmd_raw("query-block-jobs"))
    out.append(("fleece job", [clean({k: v for k, v in j.items() if k not in ("len", "offset")})
                               for j in jobs]))
    c("block-job-cancel", device="fleece")
    wait_gone(q, "fleece", out)
    common.blockdev_del(q, "scratch")
    c("blockdev-del", **{"node-name": "scf"})
    bitmaps(q, "disk", out, "after the pull backup")


def flow(binary, tag, base):
    disk = common.path(f"bk-{tag}-disk.qcow2")
    shutil.copy(base, disk)
    full = common.path(f"bk-{tag}-full.qcow2")
    qcow2(full)
    qcow2(common.path(f"bk-{tag}-inc.qcow2"), backing=full)
    qcow2(common.path(f"bk-{tag}-scratch.qcow2"))
    qcow2(common.path(f"bk-{tag}-small.qcow2"), size=SIZE // 2)
    sock = common.path(f"bk-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={disk}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--blockdev", f"driver=file,node-name=ff,filename={full}",
        "--blockdev", "driver=qcow2,node-name=full,file=ff",
        "--blockdev", f"driver=file,node-name=sf,filename={common.path(f'bk-{tag}-small.qcow2')}",
        "--blockdev", "driver=qcow2,node-name=small,file=sf",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()

        def c(cmd, **a):
            shown = {k: os.path.basename(v).replace(tag, "T") if k == "filename" else v
                     for k, v in a.items()}
            out.append((cmd, shown, clean(q.cmd_raw(cmd, a))))

        c("block-dirty-bitmap-add", node="disk", name="b0")
        refusals(c)
        out.append(("refusal events", job_events(q)))
        c("block-dirty-bitmap-remove", node="disk", name="b0")
        t1, t2 = push(c, q, tag, sock, out)
        pull(c, q, tag, sock, out)
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", disk)
    run("qemu-img", "check", "-q", full)
    run("qemu-img", "check", "-q", common.path(f"bk-{tag}-inc.qcow2"))
    run("qemu-img", "compare", "-F", "raw", full, t1)
    run("qemu-img", "compare", "-F", "raw", common.path(f"bk-{tag}-inc.qcow2"), t2)
    return out


def filtered_source_refused():
    """stord keeps the point in time on the source's own request path: a node that
    another passes requests to (a qcow2 image's file) is refused, with the node to back
    up instead (qsd would insert its filter above it)."""
    img = common.path("bk-filtered.qcow2")
    qcow2(img)
    tgt = common.path("bk-filtered-tgt.qcow2")
    qcow2(tgt)
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--blockdev", f"driver=file,node-name=tf,filename={tgt}",
    ])
    try:
        q = d.qmp()
        r = q.cmd_raw("blockdev-backup", {"job-id": "b", "device": "f", "target": "tf",
                                          "sync": "full"})
        assert "back up 'disk'" in r["error"]["desc"], r
        assert ok(q.cmd_raw("query-jobs")) == []
        q.close()
    finally:
        d.stop()


def test():
    base = common.path("bk-base.qcow2")
    qcow2(base)
    run("qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 32M 2M",
        "-c", "write -P 0x13 62M 2M", base)
    theirs = flow("qemu-storage-daemon", "qsd", base)
    ours = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    filtered_source_refused()


if __name__ == "__main__":
    common.main(test)
