"""Fleecing with the copy-before-write and snapshot-access drivers (QEMU's newer scheme,
no backing link between the images), the same flow against qsd and stord: the guest's
export is on a copy-before-write filter over the disk with a scratch qcow2 as its target;
a read-only NBD export serves the snapshot-access view. While fio writes through the
guest's export, nbdcopy reads the view: it is the disk as it was when the filter opened.
The filter is added and removed at run time too, and query-named-block-nodes and the
graph's edges between the nodes are qsd's."""

import json
import shutil
import subprocess
import threading

import common
from common import ok, run

SIZE = 64 << 20



def flow(binary, tag, base):
    disk, tmp = common.path(f"fl-{tag}-disk.qcow2"), common.path(f"fl-{tag}-tmp.qcow2")
    shutil.copy(base, disk)
    common.qcow2(tmp, SIZE)
    sock = common.path(f"fl-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={disk}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--blockdev", f"driver=file,node-name=tf,filename={tmp}",
        "--blockdev", "driver=qcow2,node-name=tmp,file=tf",
        "--blockdev", "driver=copy-before-write,node-name=cbw,file=disk,target=tmp",
        "--blockdev", "driver=snapshot-access,node-name=acc,file=cbw",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=cbw,name=live,writable=on",
        "--export", "type=nbd,id=pit,node-name=acc,name=pit",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    pit = f"nbd+unix:///pit?socket={sock}"
    try:
        q = d.qmp()
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        out.append(("nodes", sorted((n["node-name"], n["drv"], n["ro"]) for n in nodes)))
        graph = ok(q.cmd_raw("x-debug-query-block-graph"))
        names = {n["id"]: n["name"] or n["type"] for n in graph["nodes"]}
        out.append(("edges", sorted((names[e["parent"]], names[e["child"]], e["name"])
                                    for e in graph["edges"])))
        before = common.path(f"fl-{tag}-before.raw")
        run("nbdcopy", pit, before)
        writer = threading.Thread(target=lambda: common.fio(
            "--name=w", "--ioengine=nbd", f"--uri={live}", "--rw=randwrite", "--bs=64k",
            "--size=64M", "--io_size=48M", "--iodepth=8", "--verify=crc32c",
            "--do_verify=1"))
        writer.start()
        view = common.path(f"fl-{tag}-view.raw")
        run("nbdcopy", pit, view)
        writer.join()
        run("qemu-img", "compare", "-f", "raw", "-F", "qcow2", view, base)
        run("nbdcopy", pit, view)
        run("qemu-img", "compare", "-f", "raw", "-F", "qcow2", view, base)
        run("qemu-img", "compare", "-f", "raw", "-F", "qcow2", before, base)
        # The view is not the disk any more.
        after = common.path(f"fl-{tag}-after.raw")
        run("nbdcopy", live, after)
        r = subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", after, view])
        out.append(("disk moved on", r.returncode))
        # Taken down at run time, the filter's scratch image goes as it came.
        for e in ("pit", "live"):
            common.unexport(q, e)
        for n in ("acc", "cbw", "tmp", "tf"):
            out.append(("blockdev-del", n, q.cmd_raw("blockdev-del", {"node-name": n})))
        out.append(("re-add", q.cmd_raw("blockdev-add", {
            "driver": "qcow2", "node-name": "tmp2", "file": {
                "driver": "file", "filename": common.path(f"fl-{tag}-tmp.qcow2")}})))
        out.append(("cbw again", q.cmd_raw("blockdev-add", {
            "driver": "copy-before-write", "node-name": "cbw2", "file": "disk",
            "target": "tmp2"})))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", disk)
    run("qemu-img", "check", "-q", tmp)
    return out


def test():
    base = common.path("fl-base.qcow2")
    common.qcow2(base, SIZE)
    run("qemu-io", "-c", "write -P 0x11 0 16M", "-c", "write -P 0x12 40M 8M",
        "-c", "write -z 20M 4M", base)
    theirs = flow("qemu-storage-daemon", "qsd", base)
    ours = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))


if __name__ == "__main__":
    common.main(test)
