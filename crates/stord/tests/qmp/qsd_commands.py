"""qsd's smaller commands, the same calls against qsd and stord: every return, error and
event equal.

- nbd-server-add / nbd-server-remove (the NBD exports of libvirt before
  block-export-add): refused without a server, an export named after its device, a
  read-only node quietly exported read-only, what nbdinfo sees, removal and its errors.
- block-export-add of a vduse-blk export: its option checks and the error when the
  device cannot be created (no /dev/vduse on the host).
- block-set-write-threshold: the first write ending past the threshold (a guest offset
  on the format node) raises BLOCK_WRITE_THRESHOLD once with the amount exceeded, and
  the threshold is cleared; on the protocol node, qcow2's own writes to its file trip it
  (stord only: where qcow2 puts a cluster differs between the two).
- chardevs (chardev-add/-change/-remove/-send-break, query-chardev, ringbuf-read/-write)
  and QOM introspection (qom-list, qom-list-types, qom-list-properties): equal where the
  two have the same things (qsd has more chardev backends and object types).
- change-backing-file, x-blockdev-change, x-blockdev-amend: returns, errors, the amend
  job's events and the header's backing name.
- x-blockdev-set-iothread: QEMU's checks; an export added on a moved node runs on that
  IoThread (stord: its loop completes the export's requests).
- x-debug-query-block-graph: nodes, edges and their permissions as qsd's for a chain
  with an export; a running job drawn as a block-job node.
- query-blockstats / query-block: empty lists (no guest devices); with query-nodes, the
  counts on the format node after a known fio workload are what fio issued (stord; qsd
  counts nothing per node), the fields, parents and highest offsets written as qsd's."""

import json
import os

import common
import stream
from common import ok, run

SIZE = 64 << 20



def events(q, name):
    out = [(e["event"], e["data"]) for e in q.get_events() if e["event"] == name]
    q.clear_events()
    return out


def flow(binary, tag):
    img = common.path(f"qc-{tag}.qcow2")
    common.qcow2(img, SIZE)
    ro = common.path(f"qc-{tag}-ro.qcow2")
    common.qcow2(ro, SIZE)
    sock = common.path(f"qc-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--blockdev", f"driver=file,node-name=rof,filename={ro},read-only=on",
        "--blockdev", "driver=qcow2,node-name=ro,file=rof,read-only=on",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()

        def c(cmd, **a):
            r = q.cmd_raw(cmd, a)
            out.append((cmd, json.dumps(a).replace(f"qc-{tag}", "qc-T"), r))

        # nbd-server-add and -remove.
        c("nbd-server-add", device="disk")
        c("nbd-server-start", addr={"type": "unix", "data": {"path": sock}})
        c("nbd-server-add", device="disk")
        c("nbd-server-add", device="disk", name="w", writable=True, description="the disk")
        c("nbd-server-add", device="ro", writable=True)
        c("nbd-server-add", device="disk")
        c("nbd-server-add", device="nowhere")
        c("nbd-server-add", device="disk", name="bm", bitmap="nope")
        out.append(("exports", sorted(
            (e["id"], e["node-name"], e["type"]) for e in ok(q.cmd_raw("query-block-exports")))))
        for name in ("disk", "w", "ro"):
            info = json.loads(run("nbdinfo", "--json", f"nbd+unix:///{name}?socket={sock}"))
            e = info["exports"][0]
            out.append((name, e["export-size"], e["is_read_only"], e.get("description")))
        c("nbd-server-remove", name="ro")
        c("nbd-server-remove", name="ro")
        c("nbd-server-remove", name="w", mode="hard")
        c("nbd-server-remove", name="disk", mode="sideways")
        c("block-export-add", type="nbd", id="live", **{"node-name": "disk"}, name="live",
          writable=True)
        live = f"nbd+unix:///live?socket={sock}"

        # vduse-blk's checks, in qsd's order and words; this host has no /dev/vduse, so a
        # valid export fails to create its device (the guest test in vduse.rs serves one).
        vd = {"type": "vduse-blk", "id": "vd", "node-name": "disk", "name": "vd0"}
        for bad in ({"num-queues": 0}, {"queue-size": 3}, {"queue-size": 2048},
                    {"logical-block-size": 1000}, {"writable": True, "node-name": "ro"},
                    {"name": None}, {}):
            args = {k: v for k, v in {**vd, **bad}.items() if v is not None}
            c("block-export-add", **args)

        # Write threshold on the format node: guest offsets.
        c("block-set-write-threshold", **{"node-name": "nowhere", "write-threshold": 1})
        c("block-set-write-threshold", **{"node-name": "disk",
                                          "write-threshold": (2 << 20) + 4096})
        run("qemu-io", "-f", "raw", "-c", "write 0 4k", "-c", "write 1M 1M", live)
        out.append(("below", events(q, "BLOCK_WRITE_THRESHOLD")))
        run("qemu-io", "-f", "raw", "-c", "write 2M 64k", "-c", "write 4M 64k", live)
        out.append(("past", events(q, "BLOCK_WRITE_THRESHOLD")))
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        out.append(("cleared", sorted((n["node-name"], n["write_threshold"]) for n in nodes)))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", img)
    return out


def protocol_node_threshold():
    """qcow2's writes to its file trip the file node's threshold."""
    img = common.path("qc-proto.qcow2")
    common.qcow2(img, SIZE)
    sock = common.path("qc-proto.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ])
    try:
        q = d.qmp()
        size = os.path.getsize(img)
        ok(q.cmd_raw("block-set-write-threshold", {"node-name": "f",
                                                  "write-threshold": size + (1 << 20)}))
        run("qemu-io", "-f", "raw", "-c", "write 0 64k", f"nbd+unix:///live?socket={sock}")
        assert events(q, "BLOCK_WRITE_THRESHOLD") == []
        run("qemu-io", "-f", "raw", "-c", "write 8M 2M", f"nbd+unix:///live?socket={sock}")
        ev = events(q, "BLOCK_WRITE_THRESHOLD")
        assert len(ev) == 1, ev
        data = ev[0][1]
        assert data["node-name"] == "f" and data["write-threshold"] == size + (1 << 20), data
        assert 0 < data["amount-exceeded"] <= (2 << 20), data
        q.close()
    finally:
        d.stop()


def blockstats(binary, tag):
    """query-blockstats after a known fio workload through an NBD export: stord's counts
    on the format node are what fio issued (qsd counts only in guest devices' backends
    and reports zeroes per node); the shape of the answer and the highest offset written
    on both nodes are qsd's."""
    img = common.path(f"qb-{tag}.qcow2")
    common.qcow2(img, SIZE)
    sock = common.path(f"qb-{tag}.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()
        uri = f"nbd+unix:///live?socket={sock}"
        r = common.fio("--name=r", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
                       "--bs=4k", "--size=8M", "--io_size=8M", "--iodepth=4")
        w = common.fio("--name=w", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
                       "--bs=4k", "--size=4M", "--io_size=4M", "--iodepth=4", "--fsync=16")
        rj, wj = r["jobs"][0], w["jobs"][0]
        assert ok(q.cmd_raw("query-blockstats")) == []
        assert ok(q.cmd_raw("query-block")) == []
        stats = {e["node-name"]: e for e in ok(q.cmd_raw("query-blockstats",
                                                         {"query-nodes": True}))}
        q.close()
    finally:
        d.stop()
    disk = stats["disk"]["stats"]
    if binary == common.STORD:
        assert disk["rd_operations"] == rj["read"]["total_ios"] == 2048, disk
        assert disk["rd_bytes"] == 8 << 20, disk
        assert disk["wr_operations"] == wj["write"]["total_ios"] == 1024, disk
        assert disk["wr_bytes"] == 4 << 20, disk
        assert disk["flush_operations"] == wj["sync"]["total_ios"], (disk, wj["sync"])
        assert disk["failed_wr_operations"] == disk["invalid_rd_operations"] == 0, disk
        assert disk["rd_total_time_ns"] > 0 and disk["wr_total_time_ns"] > 0, disk
        f = stats["f"]["stats"]
        assert f["wr_operations"] > 0 and f["rd_operations"] > 0, f
    shape = {n: (sorted(e["stats"]), e.get("parent", {}).get("node-name"),
                 e["stats"]["wr_highest_offset"]) for n, e in stats.items()}
    # A node that has served a request says how long it has been idle (stord); qsd has
    # no such time for nodes.
    for n in shape:
        keys = [k for k in shape[n][0] if k != "idle_time_ns"]
        shape[n] = (keys,) + shape[n][1:]
    return shape


def editing(binary, tag):
    """change-backing-file, x-blockdev-change and x-blockdev-amend: returns, errors, the
    amend jobs' events, and the backing file the header names afterwards."""
    base, top = common.path(f"qe-{tag}-base.qcow2"), common.path(f"qe-{tag}-top.qcow2")
    common.qcow2(base, SIZE)
    common.qcow2(top, SIZE, backing=base)
    # The name the header gets (qemu-img check opens it).
    common.qcow2(common.path("renamed.qcow2"), SIZE)
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=bf,filename={base}",
        "--blockdev", "driver=qcow2,node-name=base,file=bf",
        "--blockdev", f"driver=file,node-name=tf,filename={top}",
        "--blockdev", "driver=qcow2,node-name=top,file=tf,backing=base",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()

        def c(cmd, **a):
            out.append((cmd, a, q.cmd_raw(cmd, a)))

        cbf = lambda dev, img, name="renamed.qcow2": c(
            "change-backing-file", device=dev, **{"image-node-name": img, "backing-file": name})
        cbf("top", "base")
        cbf("nowhere", "top")
        cbf("top", "nowhere")
        cbf("base", "top")
        cbf("tf", "top")
        cbf("top", "top")
        c("x-blockdev-change", parent="nowhere", child="file")
        c("x-blockdev-change", parent="top")
        c("x-blockdev-change", parent="top", child="file", node="bf")
        c("x-blockdev-change", parent="top", child="f")
        c("x-blockdev-change", parent="top", child="file")
        c("x-blockdev-change", parent="top", node="nowhere")
        c("x-blockdev-change", parent="top", node="bf")
        amend = lambda node, **o: c("x-blockdev-amend", **{"job-id": "a", "node-name": node,
                                                            "options": o})
        amend("top", driver="file")
        amend("tf", driver="file")
        amend("top", driver="qcow2", encrypt={"state": "active"})
        amend("nowhere", driver="qcow2")
        amend("top", driver="qcow2")
        stream.wait_status(q, "a", "concluded")
        c("job-dismiss", id="a")
        amend("top", driver="qcow2", encrypt={"format": "luks", "state": "active",
                                             "new-secret": "s"})
        stream.wait_status(q, "a", "concluded")
        out.append(("jobs", stream.clean(ok(q.cmd_raw("query-jobs")))))
        c("job-dismiss", id="a")
        out.append(("events", stream.job_events(q)))
        q.close()
    finally:
        d.stop()
    info = json.loads(run("qemu-img", "info", "--output=json", "-U", top))
    out.append(("header", info.get("backing-filename"), info.get("backing-filename-format")))
    run("qemu-img", "check", "-q", top)
    return out


# stord's own object types (qsd has no such type), and QEMU 11.1's monitor objects, which
# the installed qsd (10.0) lacks (monitor_object.py checks them).
OWN_TYPES = {"metrics", "monitor", "monitor-qmp"}

# stord's own iothread properties (its polling policies, reactor and scheduler slice),
# beside QEMU's.
IOTHREAD_OWN = {"poll-weight", "poll-policy", "poll-grow-start", "poll-allow-shrink",
                "poll-yield-ns", "reactor", "sched-slice-ns"}


def chardevs_and_qom(binary, tag):
    """Character devices (chardev-add/-change/-remove/-send-break, query-chardev, the
    ringbuf's bytes) and QOM introspection. Where qsd has more (its other chardev
    backends, its other object types), stord's answers are the part they share."""
    out, extra = [], {}
    d = common.Daemon([
        "--object", "iothread,id=io0",
        "--object", "secret,id=s0,data=x",
        "--chardev", "ringbuf,id=cr,size=64",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()

        def c(cmd, **a):
            r = q.cmd_raw(cmd, a)
            norm = lambda v: json.dumps(v).replace(f"qc-{tag}", "qc-T")
            out.append((cmd, norm(a), json.loads(norm(r))))
            return r

        add = lambda id, ty, **data: c("chardev-add", id=id,
                                       backend={"type": ty, "data": data})
        add("r1", "ringbuf", size=16)
        add("r1", "null")
        add("n1", "null")
        add("f1", "file", out=common.path(f"qc-{tag}-f1.out"))
        add("m1", "memory")
        add("s1", "socket", addr={"type": "unix", "data": {"path": common.path(f"qc-{tag}.s1")}},
            server=True, wait=False)
        add("r2", "ringbuf", size=15)
        out.append(("file made", os.path.exists(common.path(f"qc-{tag}-f1.out"))))
        chardevs = ok(q.cmd_raw("query-chardev"))
        out.append(("query-chardev", sorted(
            (x["label"], x["filename"].replace(f"qc-{tag}", "qc-T"),
             x["frontend-open"]) for x in chardevs if x["label"] != "mon0")))
        c("ringbuf-write", device="r1", data="hello world, this is long")
        c("ringbuf-read", device="r1", size=100)
        c("ringbuf-write", device="r1", data="aGk=", format="base64")
        c("ringbuf-read", device="r1", size=1, format="base64")
        c("ringbuf-read", device="r1", size=10)
        c("ringbuf-write", device="cr", data="from the command line")
        c("ringbuf-read", device="cr", size=4)
        c("ringbuf-read", device="n1", size=10)
        c("ringbuf-read", device="nope", size=10)
        c("ringbuf-read", device="r1", size=-1)
        c("ringbuf-write", device="f1", data="x")
        c("chardev-send-break", id="r1")
        c("chardev-send-break", id="nope")
        c("chardev-change", id="n1", backend={"type": "ringbuf", "data": {"size": 64}})
        c("ringbuf-write", device="n1", data="now a ringbuf")
        c("ringbuf-read", device="n1", size=5)
        c("chardev-change", id="mon0", backend={"type": "null", "data": {}})
        c("chardev-change", id="nope", backend={"type": "null", "data": {}})
        c("chardev-remove", id="r1")
        c("chardev-remove", id="r1")
        c("chardev-remove", id="mon0")
        backends = {b["name"] for b in ok(q.cmd_raw("query-chardev-backends"))}
        extra["backends"] = backends
        c("qom-list", path="/chardevs")
        out[-1] = (out[-1][0], out[-1][1], sorted(x["name"] + x["type"] for x in out[-1][2]["return"]))
        c("qom-list", path="/objects")
        out[-1] = (out[-1][0], out[-1][1], sorted(x["name"] + x["type"] for x in out[-1][2]["return"]))
        c("qom-list", path="/nope")
        extra["root"] = {x["name"] for x in ok(q.cmd_raw("qom-list", {"path": "/"}))}
        extra["io0"] = {x["name"]: x["type"] for x in ok(q.cmd_raw("qom-list", {"path": "io0"}))}
        extra["types"] = {t["name"]: t.get("parent") for t in
                          ok(q.cmd_raw("qom-list-types", {"implements": "user-creatable"}))}
        extra["abstract"] = {t["name"]: (t.get("parent"), t.get("abstract", False)) for t in
                             ok(q.cmd_raw("qom-list-types", {"abstract": True}))}
        extra["props"] = {}
        for t in ("throttle-group", "secret", "tls-creds-x509", "tls-creds-psk",
                  "authz-simple", "iothread"):
            r = ok(q.cmd_raw("qom-list-properties", {"typename": t}))
            extra["props"][t] = {x["name"]: x["type"] for x in r}
        c("qom-list-properties", typename="nope")
        q.close()
    finally:
        d.stop()
    return out, extra


def block_graph(binary, tag):
    """x-debug-query-block-graph over a qcow2 with a backing image and an NBD export: the
    nodes, and each edge's name and permissions, as qsd's (ids named). With a job running
    (stord only: QEMU also draws its mirror's filter node), the job is a block-job node
    with its edges."""
    base, top = common.path(f"qg-{tag}-base.qcow2"), common.path(f"qg-{tag}-top.qcow2")
    common.qcow2(base, SIZE)
    common.qcow2(top, SIZE, backing=base)
    sock = common.path(f"qg-{tag}.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=bf,filename={base}",
        "--blockdev", "driver=qcow2,node-name=base,file=bf",
        "--blockdev", f"driver=file,node-name=tf,filename={top}",
        "--blockdev", "driver=qcow2,node-name=top,file=tf,backing=base",
        "--blockdev", f"driver=null-co,node-name=n,size={SIZE}",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=e0,node-name=top,name=e0,writable=on",
    ], binary=binary, tag=tag)

    def named(g):
        names = {n["id"]: (n["name"] or "<" + n["type"] + ">") for n in g["nodes"]}
        edges = sorted((names[e["parent"]], names[e["child"]], e["name"],
                        tuple(e["perm"]), tuple(e["shared-perm"])) for e in g["edges"])
        return sorted(names.values()), edges

    try:
        q = d.qmp()
        plain = named(ok(q.cmd_raw("x-debug-query-block-graph")))
        with_job = None
        if binary == common.STORD:
            ok(q.cmd_raw("blockdev-mirror", {"job-id": "m", "device": "top", "target": "n",
                                             "sync": "full", "speed": 1}))
            with_job = named(ok(q.cmd_raw("x-debug-query-block-graph")))
            ok(q.cmd_raw("block-job-cancel", {"device": "m", "force": True}))
        q.close()
    finally:
        d.stop()
    return plain, with_job


def set_iothread(binary, tag):
    """x-blockdev-set-iothread: QEMU's checks and words; a node moved to an IoThread
    keeps the export added on it there (stord: its loop serves the export's requests)."""
    sock = common.path(f"qi-{tag}.sock")
    out = []
    d = common.Daemon([
        "--object", "iothread,id=io0", "--object", "iothread,id=io1",
        "--blockdev", f"driver=null-co,node-name=n,size={SIZE}",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()

        def c(cmd, **a):
            out.append((cmd, a, q.cmd_raw(cmd, a)))

        c("x-blockdev-set-iothread", **{"node-name": "nope", "iothread": "io0"})
        c("x-blockdev-set-iothread", **{"node-name": "n", "iothread": "nope"})
        c("x-blockdev-set-iothread", **{"node-name": "n", "iothread": "io1"})
        c("x-blockdev-set-iothread", **{"node-name": "n", "iothread": None})
        c("x-blockdev-set-iothread", **{"node-name": "n", "iothread": "io0"})
        c("block-export-add", type="nbd", id="e", **{"node-name": "n"}, name="e")
        c("x-blockdev-set-iothread", **{"node-name": "n", "iothread": "io1"})
        if binary == common.STORD:
            def served():
                return {t["id"]: t["x-stats"]["counters"].get("nbd.requests", 0)
                        for t in ok(q.cmd_raw("query-iothreads"))}
            before = served()
            common.fio("--name=r", "--ioengine=nbd", f"--uri=nbd+unix:///e?socket={sock}",
                       "--rw=randread", "--bs=4k", "--size=4M", "--io_size=4M")
            after = served()
            assert after["io0"] - before["io0"] >= 1024, (before, after)
            assert after["io1"] == before["io1"], (before, after)
            r = q.cmd_raw("x-blockdev-set-iothread",
                          {"node-name": "n", "iothread": "io1", "force": True})
            assert r["error"]["desc"] == "Cannot change iothread of active block backend", r
            r = q.cmd_raw("object-del", {"id": "io0"})
            assert "error" in r, r
        q.close()
    finally:
        d.stop()
    return out


def test():
    theirs = flow("qemu-storage-daemon", "qsd")
    ours = flow(common.STORD, "stord")
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    protocol_node_threshold()
    theirs, ours = set_iothread("qemu-storage-daemon", "qsd"), set_iothread(common.STORD, "stord")
    assert theirs == ours, f"\nqsd   {theirs}\nstord {ours}"
    (theirs, _), (ours, with_job) = block_graph("qemu-storage-daemon", "qsd"), \
        block_graph(common.STORD, "stord")
    assert theirs == ours, f"\nqsd   {theirs}\nstord {ours}"
    assert "m" in with_job[0], with_job
    job_edges = {(e[1], e[2]) for e in with_job[1] if e[0] == "m"}
    assert job_edges == {("top", "source"), ("n", "target")}, with_job
    (theirs, t_extra), (ours, o_extra) = (chardevs_and_qom("qemu-storage-daemon", "qsd"),
                                          chardevs_and_qom(common.STORD, "stord"))
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    assert o_extra["backends"] <= t_extra["backends"], o_extra["backends"]
    assert o_extra["root"] <= t_extra["root"] and "objects" in o_extra["root"]
    own = {k: v for k, v in o_extra["io0"].items() if k not in IOTHREAD_OWN}
    assert own == t_extra["io0"], (own, t_extra["io0"])
    for name, parent in o_extra["types"].items():
        if name in OWN_TYPES:
            continue
        assert t_extra["types"].get(name) == parent, (name, parent)
    for name, info in o_extra["abstract"].items():
        if name in OWN_TYPES:
            continue
        assert t_extra["abstract"].get(name) == info, (name, info)
    for t, props in o_extra["props"].items():
        mine = {k: v for k, v in props.items() if not (t == "iothread" and k in IOTHREAD_OWN)}
        assert mine == t_extra["props"][t], (t, mine, t_extra["props"][t])
    theirs, ours = editing("qemu-storage-daemon", "qsd"), editing(common.STORD, "stord")
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    theirs, ours = blockstats("qemu-storage-daemon", "qsd"), blockstats(common.STORD, "stord")
    assert theirs == ours, f"\nqsd   {theirs}\nstord {ours}"


if __name__ == "__main__":
    common.main(test)
