"""A pull backup that exports a recording bitmap, the same flow against qsd and stord.

The backup tool adds a bitmap, lets the guest write, and exports the image read-only with
the bitmap named as `{node, name}` (BlockDirtyBitmapOrStr's object form) while the bitmap
keeps recording. QEMU 10.0 accepts that: its "Enabled bitmap ... incompatible with
readonly export" applies only to a bitmap named by a string and found on the export's own
writable chain (nbd/server.c), so the string form is refused and the object form taken.
The tool then reads the dirty map over NBD, the guest writes on (the bitmap records it and
its export shows it), the export goes and the bitmap is cleared.

Every return, error, dirty-bitmaps entry and nbdinfo output equal between the two."""

import json
import shutil

import common
from common import ok, run

SIZE = 16 << 20


def flow(binary, tag, base):
    img = common.path(f"bpe-{tag}.qcow2")
    shutil.copy(base, img)
    sock = common.path(f"bpe-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    pull = f"nbd+unix:///pull?socket={sock}"
    try:
        q = d.qmp()

        def c(cmd, **a):
            out.append((cmd, a, q.cmd_raw(cmd, a)))

        def bitmaps(what):
            nodes = ok(q.cmd_raw("query-named-block-nodes"))
            disk = [n for n in nodes if n["node-name"] == "disk"][0]
            out.append((what, disk.get("dirty-bitmaps")))

        c("block-dirty-bitmap-add", node="disk", name="b0")
        run("qemu-io", "-f", "raw", "-c", "write -P 0x51 64k 64k",
            "-c", "write -P 0x52 5M 300k", live)
        # The string form, found on the export's own writable node: refused.
        c("block-export-add", type="nbd", id="pull", **{"node-name": "disk"},
          name="pull", bitmaps=["b0"])
        # The object form: taken, the bitmap still recording.
        c("block-export-add", type="nbd", id="pull", **{"node-name": "disk"},
          name="pull", bitmaps=[{"node": "disk", "name": "b0"}])
        bitmaps("exported")
        c("block-dirty-bitmap-disable", node="disk", name="b0")
        exports = ok(q.cmd_raw("query-block-exports"))
        out.append(("exports", sorted((e["id"], e["node-name"]) for e in exports)))
        info = json.loads(run("nbdinfo", "--json", pull))
        out.append(("contexts", sorted(info["exports"][0].get("contexts", []))))
        out.append(("map", json.loads(run("nbdinfo", "--json",
                                          "--map=qemu:dirty-bitmap:b0", pull))))
        # The guest writes on: the bitmap records, and the export's map shows it.
        run("qemu-io", "-f", "raw", "-c", "write -P 0x53 12M 64k", live)
        out.append(("map after a write", json.loads(run(
            "nbdinfo", "--json", "--map=qemu:dirty-bitmap:b0", pull))))
        c("block-export-del", id="pull")
        common.wait_event(q, "BLOCK_EXPORT_DELETED")
        bitmaps("unexported")
        c("block-dirty-bitmap-clear", node="disk", name="b0")
        bitmaps("cleared")
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    return out


def test():
    base = common.path("bpe-base.qcow2")
    run("qemu-img", "create", "-q", "-f", "qcow2", base, str(SIZE))
    run("qemu-io", "-c", "write -P 0x11 0 2M", base)
    theirs = flow("qemu-storage-daemon", "qsd", base)
    ours = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    # The flow refused the string form and took the object form.
    assert "error" in theirs[1][2] and "return" in theirs[2][2], theirs[:3]
    run("qemu-img", "compare", common.path("bpe-qsd.qcow2"), common.path("bpe-stord.qcow2"))


common.main(test)
