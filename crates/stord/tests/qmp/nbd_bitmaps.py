"""Dirty bitmaps over NBD (the qemu:dirty-bitmap:NAME metadata context), the same flow
against qsd and stord, as an incremental backup tool runs it:

- a checkpoint (a persistent bitmap) is added and a full backup taken with nbdcopy;
- the guest writes through a writable export (qemu-io), of every kind;
- the next checkpoint starts and the first stops recording in one `transaction` (after
  failing ones that must leave nothing behind), and a read-only export offers the first
  with `bitmaps`; nbdinfo lists the contexts and maps the bitmap;
- the dirty extents are copied onto the full backup: it then equals the image;
- QEMU's refusals: an unknown bitmap, an enabled one on a read-only export, changing or
  removing an exported (busy) bitmap; once the export goes, it may change again.

Every return, error, dirty-bitmaps entry and nbdinfo output equal between the two."""

import json
import shutil

import common
from common import ok, run

SIZE = 64 << 20



def flow(binary, tag, base):
    img = common.path(f"nbm-{tag}.qcow2")
    shutil.copy(base, img)
    sock = common.path(f"nbm-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    backup = f"nbd+unix:///backup?socket={sock}"
    try:
        q = d.qmp()
        c = lambda cmd, **a: out.append((cmd, a, q.cmd_raw(cmd, a)))

        def bitmaps(what):
            nodes = ok(q.cmd_raw("query-named-block-nodes"))
            disk = [n for n in nodes if n["node-name"] == "disk"][0]
            out.append((what, disk.get("dirty-bitmaps")))

        c("block-dirty-bitmap-add", node="disk", name="c1", persistent=True)
        full = common.path(f"nbm-{tag}-full.raw")
        run("nbdcopy", live, full)
        run("qemu-io", "-f", "raw",
            "-c", "write -P 0x41 0 4k", "-c", "write -P 0x42 3M 200k",
            "-c", "write -z 10M 1M", "-c", "write -P 0x43 33M 64k",
            "-c", "discard 1M 64k", "-c", "write -P 0x44 63M 1M", live)
        # The next checkpoint as libvirt makes it: one transaction. A failing one first:
        # everything it did is undone (c1's bits come back, c2 goes).
        def act(t, **data):
            return {"type": t, "data": data}
        add_c2 = act("block-dirty-bitmap-add", node="disk", name="c2", persistent=True)
        c("transaction", actions=[add_c2, act("block-dirty-bitmap-clear", node="disk", name="c1"),
                                  act("block-dirty-bitmap-disable", node="disk", name="c1"),
                                  act("abort")])
        c("transaction", actions=[add_c2, act("block-dirty-bitmap-merge", node="disk",
                                              target="c2", bitmaps=["c1"]),
                                  act("block-dirty-bitmap-add", node="disk", name="c1")])
        bitmaps("after failed transactions")
        c("x-debug-block-dirty-bitmap-sha256", node="disk", name="c1")
        c("transaction", actions=[add_c2, act("block-dirty-bitmap-disable", node="disk",
                                              name="c1")])
        c("transaction", actions=[act("block-dirty-bitmap-remove", node="disk", name="c2"),
                                  act("block-dirty-bitmap-enable", node="disk", name="c1"),
                                  act("abort")])
        bitmaps("after the checkpoint")
        c("block-export-add", type="nbd", id="bad", **{"node-name": "disk"},
          bitmaps=["nope"])
        c("block-export-add", type="nbd", id="bad", **{"node-name": "disk"},
          bitmaps=["c2"])
        c("block-export-add", type="nbd", id="bad", **{"node-name": "disk"},
          bitmaps=[{"node": "nowhere", "name": "c1"}])
        c("block-export-add", type="nbd", id="backup", **{"node-name": "disk"},
          name="backup", bitmaps=[{"node": "disk", "name": "c1"}])
        bitmaps("exported")
        c("block-dirty-bitmap-clear", node="disk", name="c1")
        c("block-dirty-bitmap-remove", node="disk", name="c1")
        c("block-dirty-bitmap-enable", node="disk", name="c1")
        info = json.loads(run("nbdinfo", "--json", backup))
        out.append(("contexts", info["exports"][0].get("contexts")))
        listed = run("nbdinfo", "--list", "--json",
                     f"nbd+unix://?socket={sock}")
        out.append(("list", sorted(e["export-name"] for e in json.loads(listed)["exports"])))
        dirty = json.loads(run("nbdinfo", "--json", "--map=qemu:dirty-bitmap:c1", backup))
        out.append(("map", dirty))
        # The incremental part: the dirty extents, copied onto the full backup.
        current = common.path(f"nbm-{tag}-current.raw")
        run("nbdcopy", backup, current)
        common.apply_dirty(current, full, dirty)
        run("qemu-img", "compare", "-f", "raw", "-F", "raw", full, current)
        c("block-export-del", id="backup")
        common.wait_event(q, "BLOCK_EXPORT_DELETED")
        bitmaps("unexported")
        c("block-dirty-bitmap-clear", node="disk", name="c1")
        bitmaps("cleared")
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    return out


def test():
    base = common.path("nbm-base.qcow2")
    run("qemu-img", "create", "-q", "-f", "qcow2", base, str(SIZE))
    run("qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 32M 2M", base)
    theirs = flow("qemu-storage-daemon", "qsd", base)
    ours = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    run("qemu-img", "compare", common.path("nbm-qsd.qcow2"), common.path("nbm-stord.qcow2"))


common.main(test)
