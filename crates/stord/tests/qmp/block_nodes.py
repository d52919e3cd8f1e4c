"""query-named-block-nodes as QEMU 10.1 and 10.2 extend it: each node's `children`
(BlockdevChild: the child's role and node name, in the node's child order) and its
image's `limits` (BlockLimitsInfo, as QEMU's bdrv_refresh_limits fills them).

The installed qsd (10.0) reports neither, so:

- children: the same graph in qsd draws its edges in x-debug-query-block-graph, a node's
  children in QEMU's bs->children order; stord's `children` lists exactly those, in that
  order (a qcow2 overlay: its file, then its backing image; a throttle filter: its file;
  a protocol node: none, as QEMU's iotest 184 shows);
- limits: the schema's members (the required ones always, the optional ones only when
  set) with the values QEMU's drivers give: a protocol node without O_DIRECT takes
  byte-granular requests and buffers, IOV_MAX pieces and page-sized buffers; with
  O_DIRECT its request and buffer alignment is what O_DIRECT needs; null-co keeps the
  block layer's defaults (512-byte buffers); qcow2 zeroes and discards by cluster and
  merges its children's; a filter takes its child's; an NBD client takes what the server
  advertises (nbdinfo reads the same export's block sizes), transfers and zeroing
  bounded by 32 MiB."""

import json
import os

import common
from common import ok, run

SIZE = 16 << 20


def graph_args(tag):
    """The graph, over images of its own (each daemon locks its images)."""
    base, top = common.path(f"bn-{tag}-base.qcow2"), common.path(f"bn-{tag}-top.qcow2")
    common.qcow2(base, SIZE)
    common.qcow2(top, SIZE, backing=base)
    raw = common.sparse(f"bn-{tag}-raw.img", SIZE)
    return [
        "--object", "throttle-group,id=tg",
        "--blockdev", f"driver=file,node-name=bf,filename={base}",
        "--blockdev", "driver=qcow2,node-name=base,file=bf",
        "--blockdev", f"driver=file,node-name=tf,filename={top}",
        "--blockdev", "driver=qcow2,node-name=top,file=tf,backing=base",
        "--blockdev", f"driver=null-co,node-name=disk0,size={SIZE}",
        "--blockdev", "driver=throttle,node-name=throttle0,file=disk0,throttle-group=tg",
        "--blockdev", f"driver=file,node-name=rf,filename={raw},cache.direct=on",
        "--blockdev", "driver=raw,node-name=r,file=rf",
    ]


def qsd_children(args, sock):
    """Each node's children as qsd 10.0's graph draws them, and an NBD export of `top`
    for the client node below."""
    d = common.Daemon(args + ["--nbd-server", f"addr.type=unix,addr.path={sock}",
                              "--export", "type=nbd,id=e,node-name=top,name=e"],
                      binary="qemu-storage-daemon", tag="qsd")
    try:
        q = d.qmp()
        g = ok(q.cmd_raw("x-debug-query-block-graph"))
        names = {n["id"]: (n["name"], n["type"]) for n in g["nodes"]}
        out = {name: [] for name, t in names.values() if t == "block-driver"}
        for e in g["edges"]:
            parent, kind = names[e["parent"]]
            if kind == "block-driver":
                out[parent].append({"child": e["name"], "node-name": names[e["child"]][0]})
        info = json.loads(run("nbdinfo", "--json", f"nbd+unix:///e?socket={sock}"))
        q.close()
        return out, info["exports"][0], d
    except BaseException:
        d.stop()
        raise


REQUIRED = {"request-alignment", "max-iov", "min-mem-alignment", "opt-mem-alignment"}
OPTIONAL = {"max-discard", "discard-alignment", "max-write-zeroes", "write-zeroes-alignment",
            "opt-transfer", "max-transfer", "max-hw-transfer", "max-hw-iov"}


def test():
    sock = common.path("bn-qsd.sock")
    theirs, nbd, qsd = qsd_children(graph_args("qsd"), sock)
    try:
        d = common.Daemon(graph_args("stord") + [
            "--blockdev", f"driver=nbd,node-name=nc,server.type=unix,server.path={sock},"
                          "export=e,read-only=on"])
        try:
            q = d.qmp()
            nodes = {n["node-name"]: n for n in ok(q.cmd_raw("query-named-block-nodes"))}
            q.close()
        finally:
            d.stop()
    finally:
        qsd.stop()

    # children: exactly the edges qsd draws, in its order.
    for name, want in theirs.items():
        assert nodes[name]["children"] == want, (name, nodes[name]["children"], want)
    assert nodes["top"]["children"] == [{"child": "file", "node-name": "tf"},
                                        {"child": "backing", "node-name": "base"}]
    # iotest 184's: a throttle node over null-co, and null-co's empty list.
    assert nodes["throttle0"]["children"] == [{"node-name": "disk0", "child": "file"}]
    assert nodes["disk0"]["children"] == [] and nodes["nc"]["children"] == []

    page = os.sysconf("SC_PAGESIZE")
    limits = {n: nodes[n]["image"]["limits"] for n in nodes}
    for n, lim in limits.items():
        assert REQUIRED <= set(lim) <= REQUIRED | OPTIONAL, (n, lim)
        assert all(isinstance(v, int) and v > 0 for v in lim.values()), (n, lim)
    plain = {"request-alignment": 1, "max-iov": 1024, "min-mem-alignment": 1,
             "opt-mem-alignment": page}
    assert limits["tf"] == plain and limits["bf"] == plain, limits["tf"]
    assert limits["disk0"] == dict(plain, **{"min-mem-alignment": 512}), limits["disk0"]
    assert limits["throttle0"] == limits["disk0"], limits["throttle0"]
    cluster = 65536
    assert limits["top"] == dict(plain, **{"discard-alignment": cluster,
                                           "write-zeroes-alignment": cluster}), limits["top"]
    direct = limits["rf"]
    assert direct["request-alignment"] in (512, 4096), direct
    assert direct["min-mem-alignment"] == direct["request-alignment"], direct
    assert direct["opt-mem-alignment"] == max(page, direct["request-alignment"]), direct
    # raw takes byte requests itself and its file's buffers (bdrv_merge_limits).
    assert limits["r"] == dict(direct, **{"request-alignment": 1}), limits["r"]
    # The NBD client: the server's advertised sizes (nbdinfo reads them too).
    nc = limits["nc"]
    assert nc["request-alignment"] == nbd["block_size_minimum"], (nc, nbd)
    assert nc["opt-transfer"] == nbd["block_size_preferred"], (nc, nbd)
    assert nc["max-transfer"] == min(32 << 20, nbd["block_size_maximum"]), (nc, nbd)
    assert nc["max-write-zeroes"] == nc["max-transfer"], nc
    assert nc["max-discard"] == (2**31 - 1) // nc["request-alignment"] * nc["request-alignment"]
    assert (nc["min-mem-alignment"], nc["opt-mem-alignment"], nc["max-iov"]) == (512, page, 1024)


common.main(test)
