"""Transient dirty bitmaps, the same flows against qsd and stord: add (default and explicit
granularity, disabled), writes of every kind through an NBD export (qemu-io), enable,
disable, clear, merge, remove; every return, error text, query-named-block-nodes
'dirty-bitmaps' entry and x-debug-block-dirty-bitmap-sha256 digest equal."""

import subprocess
import common
from common import ok

WRITES = [
    ["write -P 0x11 0 4k", "write -P 0x22 1M 64k", "write 3M 1",
     "write -z 10M 1M", "write -P 0x33 65535 2", "discard 20M 64k"],
    ["write -P 0x44 40M 3M", "write -z -u 50M 128k"],
    ["write -P 0x55 63M 1M"],
]


def flow(binary, tag):
    img = common.sparse(f"bm-{tag}.img", 64 << 20)
    sock = common.path(f"bm-{tag}.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=disk,filename={img}",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=e,node-name=disk,name=disk,writable=on",
    ], binary=binary, tag=tag)
    out = []
    uri = f"nbd+unix:///disk?socket={sock}"

    def write(batch):
        args = ["qemu-io", "-f", "raw"]
        for c in batch:
            args += ["-c", c]
        subprocess.run(args + [uri], check=True, capture_output=True)

    def state(q, what):
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        disk = [n for n in nodes if n["node-name"] == "disk"][0]
        out.append((what, "bitmaps", disk.get("dirty-bitmaps")))
        for b in disk.get("dirty-bitmaps", []):
            out.append((what, b["name"], q.cmd_raw("x-debug-block-dirty-bitmap-sha256",
                                                   {"node": "disk", "name": b["name"]})))

    try:
        q = d.qmp()
        c = lambda cmd, **a: out.append((cmd, a, q.cmd_raw(cmd, a)))
        c("block-dirty-bitmap-add", node="disk", name="b0")
        c("block-dirty-bitmap-add", node="disk", name="b1", granularity=4096, disabled=True)
        c("block-dirty-bitmap-add", node="disk", name="b0")
        c("block-dirty-bitmap-add", node="disk", name="")
        c("block-dirty-bitmap-add", node="disk", name="bx", granularity=1000)
        c("block-dirty-bitmap-add", node="nope", name="bx")
        state(q, "empty")
        write(WRITES[0])
        state(q, "first writes")
        c("block-dirty-bitmap-enable", node="disk", name="b1")
        write(WRITES[1])
        state(q, "b1 enabled")
        c("block-dirty-bitmap-disable", node="disk", name="b0")
        write(WRITES[2])
        state(q, "b0 disabled")
        c("block-dirty-bitmap-merge", node="disk", target="b1", bitmaps=["b0"])
        state(q, "merged")
        c("block-dirty-bitmap-clear", node="disk", name="b0")
        c("block-dirty-bitmap-merge", node="disk", target="b0",
          bitmaps=[{"node": "disk", "name": "b1"}])
        state(q, "merged back")
        c("block-dirty-bitmap-clear", node="disk", name="zz")
        c("block-dirty-bitmap-remove", node="disk", name="b1")
        c("block-dirty-bitmap-remove", node="disk", name="b1")
        state(q, "end")
        q.close()
    finally:
        d.stop()
    return out


def through_filters(binary, tag):
    """Bitmaps on the nodes below a raw node with an offset and a throttle filter see the
    writes that enter above (each QEMU node marks what passes through it); a discard only
    marks the nodes that pass discards on."""
    img = common.sparse(f"bmf-{tag}.img", 64 << 20)
    sock = common.path(f"bmf-{tag}.sock")
    d = common.Daemon([
        "--object", "throttle-group,id=tg",
        "--blockdev", f"driver=file,node-name=disk,filename={img},discard=unmap",
        "--blockdev", "driver=throttle,node-name=thr,throttle-group=tg,file=disk",
        "--blockdev", "driver=raw,node-name=top,file=thr,offset=1048576,discard=unmap",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=e,node-name=top,name=top,writable=on",
    ], binary=binary, tag=tag)
    out = []
    try:
        q = d.qmp()
        for node in ("disk", "thr", "top"):
            ok(q.cmd_raw("block-dirty-bitmap-add",
                         {"node": node, "name": "b", "granularity": 4096}))
        args = ["qemu-io", "-f", "raw"]
        for c in ["write -P 0x11 0 4k", "write -z 2M 64k", "discard 8M 64k",
                  "write -P 0x12 20M 12k"]:
            args += ["-c", c]
        subprocess.run(args + [f"nbd+unix:///top?socket={sock}"], check=True,
                       capture_output=True)
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        for n in sorted(nodes, key=lambda n: n["node-name"]):
            out.append((n["node-name"], n.get("dirty-bitmaps"),
                        q.cmd_raw("x-debug-block-dirty-bitmap-sha256",
                                  {"node": n["node-name"], "name": "b"})))
        q.close()
    finally:
        d.stop()
    return out


def test():
    theirs = flow("qemu-storage-daemon", "qsd") + through_filters("qemu-storage-daemon", "qsd")
    ours = flow(common.STORD, "stord") + through_filters(common.STORD, "stord")
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"


common.main(test)
