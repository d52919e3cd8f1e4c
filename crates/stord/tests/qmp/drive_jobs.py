"""drive-backup and drive-mirror (the forms older managers send: the target a file name),
the same flows against qsd and stord, an NBD export serving the disk (top, backed by base):

- drive-backup sync=full, sync=top (the target's header names the base), mode=existing
  into a raw file, sync=none (cancelled), one inside a transaction that aborts, and
  QEMU's refusals; each target holds the disk's content (qemu-img compare) and the
  daemon lets each target go when its job ends.
- drive-mirror sync=full to a new qcow2 with a node-name: ready, job-complete, the export
  serves the target; sync=top with a header naming the base; the refusals.

Every return and job event equal to qsd's; the images' backing names as qsd wrote them."""

import json
import os
import shutil

import common
import stream
from common import ok, run

SIZE = 32 << 20



def named_nodes(q):
    """Node names, without the ones the daemons name themselves (#block...)."""
    return sorted(n["node-name"] for n in ok(q.cmd_raw("query-named-block-nodes"))
                  if not n["node-name"].startswith("#"))


def flow(binary, tag, base_img, top_img):
    base, top = common.path(f"dj-{tag}-base.qcow2"), common.path(f"dj-{tag}-top.qcow2")
    shutil.copy(base_img, base)
    shutil.copy(top_img, top)
    run("qemu-img", "rebase", "-u", "-b", os.path.basename(base), "-F", "qcow2", top)
    t = lambda name: common.path(f"dj-{tag}-out-{name}")
    sock = common.path(f"dj-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=bf,filename={base},read-only=on",
        "--blockdev", "driver=qcow2,node-name=base,file=bf,read-only=on",
        "--blockdev", f"driver=file,node-name=tf,filename={top}",
        "--blockdev", "driver=qcow2,node-name=top,file=tf,backing=base",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=top,name=live,writable=on",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    try:
        q = d.qmp()

        def c(cmd, **a):
            shown = json.dumps(a).replace(f"dj-{tag}-", "dj-T-")
            out.append((cmd, shown, q.cmd_raw(cmd, a)))

        def done(job):
            stream.wait_status(q, job, "gone")
            out.append(("events", stream.job_events(q)))
            out.append(("nodes", named_nodes(q)))

        now = t("now.raw")
        run("nbdcopy", live, now)
        db = lambda job, **a: c("drive-backup", **{"job-id": job, "device": "top", **a})
        db("full", sync="full", target=t("full.qcow2"))
        done("full")
        db("topb", sync="top", target=t("top.qcow2"))
        done("topb")
        with open(t("exist.raw"), "wb") as f:
            f.truncate(SIZE)
        db("ex", sync="full", target=t("exist.raw"), mode="existing", format="raw")
        done("ex")
        db("none", sync="none", target=t("none.qcow2"))
        c("block-job-cancel", device="none")
        done("none")
        c("transaction", actions=[
            {"type": "drive-backup", "data": {"job-id": "tx", "device": "top", "sync": "full",
                                              "target": t("tx.qcow2")}},
            {"type": "abort", "data": {}}])
        out.append(("events", stream.job_events(q)))
        out.append(("nodes", named_nodes(q)))
        db("bad", sync="full", target=common.path("nope/x.qcow2"), mode="existing")
        db("bad", sync="full", target=t("bad.img"), format="null-co")
        db("bad", sync="full", device="nowhere", target=t("bad.qcow2"))
        db("bad", sync="incremental", target=t("bad.qcow2"))
        out.append(("events", stream.job_events(q)))

        dm = lambda job, **a: c("drive-mirror", **{"job-id": job, "device": "top", **a})
        dm("bad", sync="full", target=t("m-bad.qcow2"), replaces="top")
        dm("bad", sync="full", target=t("m-bad.qcow2"), device="base")
        dm("topm", sync="top", target=t("m-top.qcow2"))
        stream.wait_status(q, "topm", "ready")
        c("block-job-cancel", device="topm")
        done("topm")
        dm("fullm", sync="full", target=t("m-full.qcow2"), **{"node-name": "mirrored"})
        stream.wait_status(q, "fullm", "ready")
        c("job-complete", id="fullm")
        done("fullm")
        exports = ok(q.cmd_raw("query-block-exports"))
        out.append(("exports", [(e["id"], e["node-name"]) for e in exports]))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    for name in ("full.qcow2", "top.qcow2", "m-top.qcow2", "m-full.qcow2"):
        run("qemu-img", "check", "-q", t(name))
        info = json.loads(run("qemu-img", "info", "--output=json", t(name)))
        out.append((name, os.path.basename(info.get("backing-filename", "")),
                    info.get("backing-filename-format")))
    for name, fmt in (("full.qcow2", "qcow2"), ("top.qcow2", "qcow2"), ("exist.raw", "raw"),
                      ("m-top.qcow2", "qcow2"), ("m-full.qcow2", "qcow2")):
        run("qemu-img", "compare", "-f", fmt, "-F", "raw", t(name), now)
    return [tuple(json.dumps(x).replace(f"dj-{tag}-", "dj-T-") for x in o) for o in out]


def test():
    base, top = common.path("dj-base.qcow2"), common.path("dj-top.qcow2")
    common.qcow2(base, SIZE)
    run("qemu-io", "-c", "write -P 0x11 0 4M", "-c", "write -P 0x12 20M 1M", base)
    common.qcow2(top, SIZE, backing=base)
    run("qemu-io", "-c", "write -P 0x21 2M 3M", "-c", "write -z 20M 64k", top)
    theirs = flow("qemu-storage-daemon", "qsd", base, top)
    ours = flow(common.STORD, "stord", base, top)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))


if __name__ == "__main__":
    common.main(test)
