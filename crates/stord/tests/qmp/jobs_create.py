"""blockdev-create as a job, the same flow against qsd and stord: the same returns, error
texts, JOB_STATUS_CHANGE sequences and query-jobs answers; the images each daemon made
are clean for qemu-img check, report the same format details, take writes through QEMU,
and are identical to qsd's (qemu-img compare)."""

import os
import subprocess
import common

IMG_OPTS = [
    # (name, qcow2 options beyond driver/file/size)
    ("default", {}),
    ("v2", {"version": "v2"}),
    ("small", {"cluster-size": 512, "refcount-bits": 1}),
    ("big", {"cluster-size": 2 << 20, "refcount-bits": 64, "lazy-refcounts": True}),
    ("zstd", {"compression-type": "zstd"}),
    ("backed", {"backing-file": "base.raw", "backing-fmt": "raw"}),
    ("extl2", {"extended-l2": True, "cluster-size": 128 << 10}),
    # Preallocated: every cluster mapped in the image (Proxmox's default is metadata),
    # the storage left sparse, allocated, or written with zeroes.
    ("prealloc-metadata", {"preallocation": "metadata"}),
    ("prealloc-falloc", {"preallocation": "falloc", "size": 16 << 20}),
    ("prealloc-full", {"preallocation": "full", "size": 8 << 20, "cluster-size": 32768}),
    ("prealloc-extl2-backed", {"preallocation": "metadata", "extended-l2": True,
                               "cluster-size": 128 << 10, "backing-file": "base.raw",
                               "backing-fmt": "raw"}),
    # Refused by the job: a backing file with preallocation needs extended L2 entries.
    ("prealloc-backed", {"preallocation": "metadata", "backing-file": "base.raw"}),
]
REFUSED = {"prealloc-backed"}


def events(q):
    return [(e["event"], e["data"].get("id"), e["data"].get("status")) for e in q.get_events()
            if e["event"] == "JOB_STATUS_CHANGE"]


def wait_concluded(q, job):
    for _ in range(500):
        jobs = q.cmd_raw("query-jobs")["return"]
        if any(j["id"] == job and j["status"] == "concluded" for j in jobs):
            return jobs
        import time
        time.sleep(0.01)
    raise AssertionError(f"{job} did not conclude: {jobs}")


def flow(binary, tag):
    d = common.Daemon([], binary=binary, tag=tag)
    out = []
    base = common.path(f"{tag}-base.raw")
    with open(base, "wb") as f:
        f.truncate(64 << 20)
    try:
        q = d.qmp()
        for name, extra in IMG_OPTS:
            img = common.path(f"{tag}-{name}.qcow2")
            if os.path.exists(img):
                os.unlink(img)
            r = q.cmd_raw("blockdev-create", {"job-id": "f" + name, "options": {
                "driver": "file", "filename": img, "size": 0}})
            out.append(("create file", name, r))
            out.append(("jobs", name, strip(wait_concluded(q, "f" + name))))
            out.append(("dismiss", name, q.cmd_raw("job-dismiss", {"id": "f" + name})))
            out.append(("add", name, q.cmd_raw("blockdev-add", {
                "driver": "file", "node-name": "n" + name, "filename": img})))
            opts = {"driver": "qcow2", "file": "n" + name, "size": 128 << 20}
            opts.update(extra)
            if "backing-file" in extra:
                opts["backing-file"] = base
            out.append(("create qcow2", name, q.cmd_raw("blockdev-create", {"job-id": "q" + name, "options": opts})))
            out.append(("jobs", name, strip(wait_concluded(q, "q" + name))))
            out.append(("dismiss", name, q.cmd_raw("job-dismiss", {"id": "q" + name})))
            out.append(("del", name, q.cmd_raw("blockdev-del", {"node-name": "n" + name})))
        # Errors: the schema's (no job), the job's own (a job that aborts), the verbs'.
        out.append(("bad option", "", q.cmd_raw("blockdev-create", {"job-id": "x", "options": {
            "driver": "qcow2", "file": "ndefault", "size": 1, "bogus": 1}})))
        out.append(("bad type", "", q.cmd_raw("blockdev-create", {"job-id": "x", "options": {
            "driver": "file", "filename": 5, "size": 0}})))
        out.append(("no node", "", q.cmd_raw("blockdev-create", {"job-id": "e1", "options": {
            "driver": "qcow2", "file": "nope", "size": 1 << 20}})))
        out.append(("jobs", "e1", strip(wait_concluded(q, "e1"))))
        out.append(("same id", "", q.cmd_raw("blockdev-create", {"job-id": "e1", "options": {
            "driver": "file", "filename": common.path(f"{tag}-x"), "size": 0}})))
        q.cmd_raw("blockdev-add", {"driver": "file", "node-name": "odd",
                                   "filename": common.path(f"{tag}-default.qcow2")})
        out.append(("odd size", "", q.cmd_raw("blockdev-create", {"job-id": "e2", "options": {
            "driver": "qcow2", "file": "odd", "size": 1000}})))
        out.append(("jobs", "e2", strip(wait_concluded(q, "e2"))))
        out.append(("dismiss unknown", "", q.cmd_raw("job-dismiss", {"id": "zz"})))
        out.append(("finalize concluded", "", q.cmd_raw("job-finalize", {"id": "e2"})))
        for j in ("e1", "e2"):
            out.append(("dismiss", j, q.cmd_raw("job-dismiss", {"id": j})))
        out.append(("jobs at end", "", q.cmd_raw("query-jobs")))
        out.append(("events", "", events(q)))
        q.close()
    finally:
        d.stop()
    return out


def strip(jobs):
    return sorted(jobs, key=lambda j: j["id"])


def info(img):
    import json
    v = json.loads(subprocess.run(["qemu-img", "info", "--output=json", img],
                                  check=True, capture_output=True, text=True).stdout)
    spec = v.get("format-specific", {}).get("data", {})
    return (v["format"], v["virtual-size"], v["cluster-size"], v.get("backing-filename"),
            v.get("backing-filename-format"), spec.get("compat"), spec.get("lazy-refcounts"),
            spec.get("refcount-bits"), spec.get("compression-type"), spec.get("extended-l2"))


def allocation(img):
    """qemu-img map's extents without their host offsets (the layouts may differ)."""
    import json
    m = json.loads(subprocess.run(["qemu-img", "map", "--output=json", img], check=True,
                                  capture_output=True, text=True).stdout)
    return [(e["start"], e["length"], e["present"], e["zero"], e["data"]) for e in m]


def disk_kib(img):
    return os.stat(img).st_blocks // 2


def test():
    theirs = flow("qemu-storage-daemon", "qsd")
    ours = flow(common.STORD, "stord")
    for a, b in zip(theirs, ours):
        assert a == b, f"qsd {a}\nstord {b}"
    assert len(theirs) == len(ours)
    for name, extra in IMG_OPTS:
        if name in REFUSED:
            continue
        q_img, s_img = common.path(f"qsd-{name}.qcow2"), common.path(f"stord-{name}.qcow2")
        subprocess.run(["qemu-img", "check", s_img], check=True, capture_output=True)
        assert allocation(q_img) == allocation(s_img), (name, allocation(q_img),
                                                        allocation(s_img))
        if extra.get("preallocation") in ("falloc", "full"):
            # The data area is on the disk, for stord's image as for qsd's.
            want = extra["size"] // 1024
            assert disk_kib(s_img) >= want and disk_kib(q_img) >= want, (
                name, disk_kib(q_img), disk_kib(s_img))
        i_q, i_s = info(q_img), info(s_img)
        # The backing file's path names each daemon's own base.
        assert i_q[:3] == i_s[:3] and i_q[4:] == i_s[4:], (name, i_q, i_s)
        assert (i_q[3] is None) == (i_s[3] is None)
        # QEMU writes into it, and it reads back.
        for img in (q_img, s_img):
            subprocess.run(["qemu-io", "-c", "write -P 0x5c 1M 192k", img], check=True,
                           capture_output=True)
            subprocess.run(["qemu-io", "-c", "read -P 0x5c 1M 192k", img], check=True,
                           capture_output=True)
        subprocess.run(["qemu-img", "check", s_img], check=True, capture_output=True)
        subprocess.run(["qemu-img", "compare", q_img, s_img], check=True, capture_output=True)


common.main(test)
