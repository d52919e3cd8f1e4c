"""driver=rbd on a real Ceph cluster (one monitor, one bluestore OSD on 127.0.0.1, started
by scripts/ceph-cluster.sh): the same flows against qsd and stord.

- blockdev-create of rbd images (created; exists; a cluster size that is no power of two;
  a snapshot name; a missing pool) and blockdev-add's refusals (missing image, pool,
  conf file, snapshot; a snapshot opened writable), with QEMU's texts and classes; the
  node's query entry; block_resize grows the image.
- fio verify (nbd engine) through an NBD export of an rbd node, and through a FUSE export
  on stord; `rbd export` of the image equals nbdcopy of the export; an rbd snapshot opens
  read-only and reads what the image held when it was taken; block status from the
  object map: qemu-img map of an export shows the objects written and holes elsewhere.
- qcow2 over an rbd node: blockdev-create qcow2 on it, fio verify, then the same pattern
  written by qemu-io on both daemons; `rbd export`ed, qemu-img check finds both clean
  and compare finds them identical.
- The OSD killed mid-I/O and restarted 2 s later: fio verify through the export waits
  and goes on with no error; meanwhile QMP answers and another export serves.
- stord only, with the OSD down: an rbd node is deleted within the close's 5 s bound
  (the monitor does not wait for the cluster), and stord stopped (SIGTERM) while a write
  through its export waits exits within its bounds (the exports' 5 s, the flush's 10 s)
  with status 1, rather than waiting for the cluster."""

import json
import os
import random
import re
import signal
import subprocess
import threading
import time

import common
from common import ok

SIZE = 64 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTER = os.path.join(HERE, "../../../../scripts/ceph-cluster.sh")


class Cluster:
    def __init__(self):
        self.dir = common.path("ceph")
        env = dict(os.environ, CEPH_OBJECTSTORE="bluestore")
        for _ in range(5):
            env["CEPH_MON_PORT"] = str(random.randint(36000, 36999))
            r = subprocess.run([CLUSTER, "start", self.dir], env=env, capture_output=True,
                               text=True)
            if r.returncode == 0:
                break
            print(r.stderr)
        assert r.returncode == 0, r.stderr
        self.env = env
        self.conf = r.stdout.strip().splitlines()[-1]

    def rbd(self, *args):
        return subprocess.run(["timeout", "60", "rbd", "-c", self.conf] + list(args),
                              capture_output=True, text=True, check=True).stdout

    def osd(self, what):
        subprocess.run([CLUSTER, what, self.dir], env=self.env, check=True,
                       capture_output=True)

    def stop(self):
        subprocess.run([CLUSTER, "stop", self.dir], env=self.env)


def wait_job(q, job):
    deadline = time.time() + 60
    while time.time() < deadline:
        for j in q.cmd_raw("query-jobs")["return"]:
            if j["id"] == job and j["status"] == "concluded":
                ok(q.cmd_raw("job-dismiss", {"id": job}))
                return j.get("error", "ok")
        time.sleep(0.05)
    raise AssertionError(f"job {job} did not conclude")


def create(q, options):
    r = q.cmd_raw("blockdev-create", {"job-id": "c", "options": options})
    if "error" in r:
        return r["error"]
    return wait_job(q, "c")


def uri(tag, name):
    return f"nbd+unix:///{name}?socket={common.path(f'rb-{tag}-exp.sock')}"


def fio_verify(target, offset, size="8M", extra=()):
    return common.fio("--name=v", "--rw=randwrite", "--bs=4k", f"--offset={offset}",
                      f"--size={size}", "--verify=crc32c", "--do_verify=1", "--iodepth=16",
                      *target, *extra)


def nbd_target(tag, name):
    return ["--ioengine=nbd", f"--uri={uri(tag, name)}"]


def qemu_io_uri(u, *cmds):
    args = ["qemu-io", "-f", "raw"]
    for c in cmds:
        args += ["-c", c]
    return subprocess.run(args + [u], capture_output=True, text=True)


def export(q, name, node):
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": name, "node-name": node,
                                      "name": name, "writable": True, "iothread": "io0"}))


unexport = common.unexport


def run(binary, tag, c):
    stord = tag == "stord"
    out = []
    d = common.Daemon(["--object", "iothread,id=io0", "--nbd-server",
                       f"addr.type=unix,addr.path={common.path(f'rb-{tag}-exp.sock')}"],
                      binary=binary, tag=tag)
    q = d.qmp()
    loc = {"pool": "rbd", "conf": c.conf}

    def img(name):
        return dict(loc, image=f"{tag}-{name}")

    # blockdev-create and its refusals.
    out.append(create(q, {"driver": "rbd", "location": img("disk"), "size": SIZE}))
    out.append(create(q, {"driver": "rbd", "location": img("disk"), "size": SIZE}))
    out.append(create(q, {"driver": "rbd", "location": img("x"), "size": SIZE,
                          "cluster-size": 3000}))
    out.append(create(q, {"driver": "rbd", "location": dict(img("x"), snapshot="s"),
                          "size": SIZE}))
    out.append(create(q, {"driver": "rbd", "location": dict(img("x"), pool="nopool"),
                          "size": SIZE}))
    assert c.rbd("info", f"rbd/{tag}-disk").count("size 64 MiB") == 1

    # blockdev-add's refusals.
    def add(**kw):
        a = {"driver": "rbd", "node-name": "bad"}
        a.update(kw)
        r = q.cmd_raw("blockdev-add", a)
        return r.get("error", r)
    out.append(add(**dict(loc, image="nope")))
    out.append(add(**dict(img("disk"), pool="nopool")))
    out.append(add(**dict(img("disk"), conf=common.path("no.conf"))))
    out.append(add(**dict(img("disk"), snapshot="nosnap", **{"read-only": True})))

    # Data through an NBD export (and FUSE on stord).
    ok(q.cmd_raw("blockdev-add", dict(img("disk"), driver="rbd", **{"node-name": "disk"})))
    out.append(q.cmd_raw("block_resize", {"node-name": "disk", "size": SIZE * 2}))
    assert "size 128 MiB" in c.rbd("info", f"rbd/{tag}-disk")
    entry = [n for n in q.cmd_raw("query-named-block-nodes")["return"]
             if n["node-name"] == "disk"][0]
    assert json.loads(entry["file"][len("json:"):]) == dict(img("disk"), driver="rbd"), entry
    # children and the image's limits: QEMU 10.1's and 10.2's, which the installed qsd
    # 10.0 lacks (block_nodes.py checks them).
    out.append({k: v for k, v in entry.items() if k not in ("file", "image", "children")})
    image = {k: v for k, v in entry["image"].items() if k not in ("filename", "limits")}
    out.append({k: v for k, v in image.items() if k not in ("cluster-size",
                                                           "format-specific")})
    # cache.direct turns librbd's cache off (QEMU's rbd_cache=false); the node says so.
    ok(q.cmd_raw("blockdev-add", dict(img("disk"), driver="rbd", **{
        "node-name": "dc", "cache": {"direct": True, "no-flush": True}})))
    out.append([n["cache"] for n in q.cmd_raw("query-named-block-nodes")["return"]
                if n["node-name"] in ("dc", "disk")])
    ok(q.cmd_raw("blockdev-del", {"node-name": "dc"}))
    export(q, "disk", "disk")
    fio_verify(nbd_target(tag, "disk"), "8M")
    fio_verify(nbd_target(tag, "disk"), "20M", "16M", ("--bsrange=512-2M", "--rw=randrw"))
    if stord:
        mnt = common.path(f"rb-{tag}-fuse")
        open(mnt, "w").close()
        ok(q.cmd_raw("block-export-add", {"type": "fuse", "id": "f0", "node-name": "disk",
                                          "mountpoint": mnt, "writable": True,
                                          "iothread": ["io0"]}))
        fio_verify(["--ioengine=psync", f"--filename={mnt}", "--direct=1"], "48M", "4M",
                   ("--iodepth=1",))
        unexport(q, "f0")
    copy = common.path(f"rb-{tag}-copy.raw")
    subprocess.run(["nbdcopy", uri(tag, "disk"), copy], check=True)
    unexport(q, "disk")
    # The export is deleted, but its last NBD client may still be letting go of the node.
    common.blockdev_del(q, "disk")
    exported = common.path(f"rb-{tag}-export.raw")
    if os.path.exists(exported):
        os.unlink(exported)
    c.rbd("export", f"rbd/{tag}-disk", exported)
    with open(copy, "rb") as a, open(exported, "rb") as b:
        assert a.read() == b.read(), "rbd export differs from what the export read"

    # A snapshot: read-only, and what the image held then.
    c.rbd("snap", "create", f"rbd/{tag}-disk@s1")
    out.append(add(**dict(img("disk"), snapshot="s1")))
    ok(q.cmd_raw("blockdev-add", dict(img("disk"), driver="rbd", snapshot="s1",
                                      **{"node-name": "snap", "read-only": True})))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "snap", "node-name": "snap",
                                      "name": "snap"}))
    snap_copy = common.path(f"rb-{tag}-snap.raw")
    subprocess.run(["nbdcopy", uri(tag, "snap"), snap_copy], check=True)
    with open(snap_copy, "rb") as a, open(exported, "rb") as b:
        assert a.read() == b.read(), "the snapshot reads differently"
    unexport(q, "snap")
    ok(q.cmd_raw("blockdev-del", {"node-name": "snap"}))

    # Block status from the image's object map (fast-diff, on by default): qemu-img map
    # of the export shows the objects written as data and the rest as zero holes.
    out.append(create(q, {"driver": "rbd", "location": img("m"), "size": SIZE}))
    ok(q.cmd_raw("blockdev-add", dict(img("m"), driver="rbd", **{"node-name": "m"})))
    export(q, "m", "m")
    r = qemu_io_uri(uri(tag, "m"), "write -P 0x71 8M 64k", "write -P 0x72 20M 4M")
    assert r.returncode == 0 and "error" not in r.stdout, r
    m = subprocess.run(["qemu-img", "map", "--output=json", "-f", "raw", uri(tag, "m")],
                       capture_output=True, text=True, check=True)
    extents = [(e["start"], e["length"], e["data"], e["zero"]) for e in json.loads(m.stdout)]
    print(tag, "rbd map:", extents, flush=True)
    assert (8 << 20, 4 << 20, True, False) in extents, extents
    assert any(not e[2] for e in extents), extents
    out.append(extents)
    unexport(q, "m")
    ok(q.cmd_raw("blockdev-del", {"node-name": "m"}))

    # qcow2 over rbd.
    out.append(create(q, {"driver": "rbd", "location": img("q"), "size": SIZE + (16 << 20)}))
    ok(q.cmd_raw("blockdev-add", dict(img("q"), driver="rbd", **{"node-name": "qf"})))
    out.append(create(q, {"driver": "qcow2", "file": "qf", "size": SIZE}))
    ok(q.cmd_raw("blockdev-add", {"driver": "qcow2", "node-name": "q", "file": "qf"}))
    export(q, "q", "q")
    fio_verify(nbd_target(tag, "q"), "4M")
    r = qemu_io_uri(uri(tag, "q"), "write -P 0x61 0 16M", "write -z 24M 1M",
                    "write -P 0x62 60M 64k", "discard 2M 1M")
    assert r.returncode == 0 and "error" not in r.stdout, r
    unexport(q, "q")
    ok(q.cmd_raw("blockdev-del", {"node-name": "q"}))
    ok(q.cmd_raw("blockdev-del", {"node-name": "qf"}))
    qimg = common.path(f"rb-{tag}-q.qcow2")
    if os.path.exists(qimg):
        os.unlink(qimg)
    c.rbd("export", f"rbd/{tag}-q", qimg)
    subprocess.run(["qemu-img", "check", "-q", qimg], check=True)

    # The OSD killed mid-I/O and restarted: requests wait, nothing is lost.
    ok(q.cmd_raw("blockdev-add", dict(img("disk"), driver="rbd", **{"node-name": "disk"})))
    ok(q.cmd_raw("blockdev-add", {"driver": "null-co", "node-name": "other",
                                  "size": 1 << 20}))
    export(q, "disk", "disk")
    export(q, "other", "other")
    seen = {}

    def bounce():
        time.sleep(1.0)
        c.osd("osd-kill")
        time.sleep(0.5)
        t0 = time.time()
        ok(q.cmd_raw("query-block-exports"))
        seen["qmp"] = time.time() - t0 < 2
        r = qemu_io_uri(uri(tag, "other"), "read 0 64k")
        seen["other"] = r.returncode == 0 and "error" not in r.stdout
        time.sleep(1.5)
        c.osd("osd-start")
    t = threading.Thread(target=bounce)
    t.start()
    res = fio_verify(nbd_target(tag, "disk"), "64M", "16M", ("--iodepth=4", "--rate_iops=1500"))
    t.join()
    faults = {"fio across the OSD restart": res["jobs"][0]["error"] == 0,
              "QMP answers with the OSD down": seen.get("qmp"),
              "another export serves with the OSD down": seen.get("other")}
    unexport(q, "disk")
    unexport(q, "other")
    common.blockdev_del(q, "disk")
    d.stop()
    # Only the image names carry the daemon's tag (the test directory's name may hold one).
    norm = [re.sub(rf"\b{tag}-(disk|x|q|m)\b", r"TAG-\1", json.dumps(x, sort_keys=True))
            for x in out]
    return norm, qimg, faults


def stop_with_osd_down(c):
    """How long stord takes to stop (SIGTERM) with the OSD down and a write waiting."""
    tag = "stordo"
    sock = common.path(f"rb-{tag}-exp.sock")
    d = common.Daemon(["--nbd-server", f"addr.type=unix,addr.path={sock}"],
                      binary=common.STORD, tag=tag)
    q = d.qmp()
    loc = {"pool": "rbd", "conf": c.conf, "image": f"{tag}-disk"}
    assert create(q, {"driver": "rbd", "location": loc, "size": SIZE}) == "ok"
    ok(q.cmd_raw("blockdev-add", dict(loc, driver="rbd", **{"node-name": "disk"})))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "disk", "node-name": "disk",
                                      "name": "disk", "writable": True}))
    ok(q.cmd_raw("blockdev-add", dict(loc, driver="rbd", **{"node-name": "idle"})))
    c.osd("osd-kill")
    try:
        # A node deleted with the OSD down: its close cannot reach the cluster, and the
        # monitor (the main loop) must not wait for it past the close's bound.
        t0 = time.time()
        r = {}
        t = threading.Thread(target=lambda: r.update(
            d=q.cmd_raw("blockdev-del", {"node-name": "idle"})), daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "blockdev-del waited for the cluster"
        ok(r["d"])
        deleted_in = time.time() - t0
        assert deleted_in < 10, deleted_in
        writer = subprocess.Popen(["qemu-io", "-f", "raw", "-c", "write -P 0x33 0 1M",
                                   f"nbd+unix:///disk?socket={sock}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        assert writer.poll() is None, "the write should wait for the OSD"
        t0 = time.time()
        d.signal(signal.SIGTERM)
        try:
            rc = d.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
            raise AssertionError("stord did not stop within 40 s with the OSD down")
        took = time.time() - t0
        writer.kill()
        writer.wait()
    finally:
        c.osd("osd-start")
    q.close()
    # Exports 5 s, flush 10 s, the close 5 s, and slack for a loaded machine.
    assert took < 25, took
    # It stopped without finishing (the write is abandoned) and says so in its status.
    assert rc == 1, rc


def test():
    c = Cluster()
    try:
        qsd, qsd_img, _ = run("qemu-storage-daemon", "qsd", c)
        st, st_img, faults = run(common.STORD, "stord", c)
        stop_with_osd_down(c)
    finally:
        c.stop()
    for i, (a, b) in enumerate(zip(qsd, st)):
        assert a == b, f"step {i}:\n qsd   {a}\n stord {b}"
    assert len(qsd) == len(st)
    assert all(faults.values()), faults
    r = subprocess.run(["qemu-img", "compare", "-q", qsd_img, st_img])
    assert r.returncode == 0, "the qcow2 images over rbd differ"


if __name__ == "__main__":
    common.main(test)
