"""blockdev-backup with compress=true, the same flows against qsd and stord:

- One source (compressible runs, an incompressible cluster, zero clusters, holes, and a
  short last cluster: its size is no multiple of the cluster size), backed up with
  compress=true into fresh qcow2 images of each kind: zlib and zstd compression types,
  4 KiB clusters (a backup cluster is sixteen image clusters), extended L2 entries (128
  KiB clusters), 1-bit refcounts (no host cluster can be shared), a target under a
  throttle filter, one blockdev-create wrote (compared byte for byte with qemu-img's
  image of the same options first), and the image drive-backup makes.
- QEMU's refusals: a raw target cannot take compressed writes; a target cluster that
  holds data cannot be overwritten compressed (the job fails with EIO).

Every return and event equal between the two daemons; each target qemu-img check clean,
qemu-img compare equal to the source and to qsd's target, and qemu-img map listing the
same extents (compressed, data, zero) as qsd's: the data clusters are compressed, the
incompressible one is not. Then stord's targets are written over (qemu-io through a
stord NBD export, and the same writes straight into qsd's targets): compressed clusters
overwritten by normal writes, the host clusters they shared given back; check clean and
compare equal again. Last, two flows of stord's alone: a freed shared host cluster is not
packed into again, and a daemon killed mid-backup leaves at most leaks."""

import json
import os
import random
import shutil
import subprocess
import time

import common
from common import ok, run
from stream import clean, job_events, wait_status

CLUSTER = 64 << 10
# Eight full megabytes and a short last cluster.
SIZE = (8 << 20) + (36 << 10)

TARGETS = [
    ("zlib", "compression_type=zlib"),
    ("zstd", "compression_type=zstd"),
    ("small", "compression_type=zstd,cluster_size=4096"),
    ("extl2", "compression_type=zlib,extended_l2=on,cluster_size=131072"),
    ("rc1", "compression_type=zlib,refcount_bits=1"),
    ("thr", "compression_type=zstd"),
]

# blockdev-create's options for the created target, and qemu-img's for the same image.
CREATE = {"compression-type": "zstd", "cluster-size": 32768}
CREATE_IMG = "compression_type=zstd,cluster_size=32768"


def make_source(path):
    """The source's content as a raw file, then a qcow2 of it with zero clusters."""
    rnd = random.Random(57)
    raw = path + ".raw"
    with open(raw, "wb") as f:
        f.truncate(SIZE)
        # Text that compresses well, over a few clusters and across cluster edges.
        text = b"".join(b"cluster %08d of the backup source. " % i for i in range(8000))
        f.seek(0)
        f.write(text[:300 << 10])
        # One cluster of noise: it does not shrink, and is written as a normal cluster.
        f.seek(1 << 20)
        f.write(rnd.randbytes(CLUSTER))
        # Half noise, half pattern: compresses a little.
        f.seek(2 << 20)
        f.write(rnd.randbytes(CLUSTER // 2) + b"\x5a" * (CLUSTER // 2))
        # A run of small repeating records.
        f.seek(4 << 20)
        f.write(bytes(range(256)) * (1 << 12))
        # The short last cluster.
        f.seek(SIZE - (36 << 10))
        f.write(b"last cluster " * 2000)
    run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, path)
    # A zero cluster written over data, and data written into the middle of a hole.
    run("qemu-io", "-c", "write -z 128k 64k", "-c", "write -P 0x33 6M 12k", path)


def qcow2_target(path, opts, size=SIZE):
    if os.path.exists(path):
        os.unlink(path)
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", opts, path, str(size))


def wait_done(q, job, out, failing=False):
    """Events until `job` has concluded and is gone (of a `failing` one, without the
    progress: how far its other copies got when one failed is a matter of timing)."""
    wait_status(q, job, "gone", timeout=60)
    events = job_events(q)
    if failing:
        events = [(e, {k: v for k, v in d.items() if k not in ("len", "offset")})
                  for e, d in events]
    out.append(("events", job, events))


def targets(tag):
    return {name: common.path(f"bc-{tag}-{name}.qcow2") for name, _ in TARGETS}


def flow(binary, tag, src):
    disk = common.path(f"bc-{tag}-src.qcow2")
    shutil.copy(src, disk)
    imgs = targets(tag)
    for name, opts in TARGETS:
        qcow2_target(imgs[name], opts)
    used = common.path(f"bc-{tag}-used.qcow2")
    qcow2_target(used, "compression_type=zlib")
    run("qemu-io", "-c", "write -P 0x44 64k 64k", used)
    raw = common.path(f"bc-{tag}-raw.img")
    with open(raw, "wb") as f:
        f.truncate(SIZE)
    created = common.path(f"bc-{tag}-created.qcow2")
    with open(created, "wb"):
        pass
    args = [
        "--object", "throttle-group,id=tg,x-bps-total=1073741824",
        "--blockdev", f"driver=file,node-name=sf,filename={disk}",
        "--blockdev", "driver=qcow2,node-name=src,file=sf",
        "--blockdev", f"driver=file,node-name=rawf,filename={raw}",
        "--blockdev", "driver=raw,node-name=rawfmt,file=rawf",
        "--blockdev", f"driver=file,node-name=uf,filename={used}",
        "--blockdev", "driver=qcow2,node-name=used,file=uf",
        "--blockdev", f"driver=file,node-name=cf,filename={created}",
    ]
    for name, _ in TARGETS:
        args += ["--blockdev", f"driver=file,node-name={name}-f,filename={imgs[name]}"]
        fmt = f"{name}-q" if name == "thr" else name
        args += ["--blockdev", f"driver=qcow2,node-name={fmt},file={name}-f"]
    args += ["--blockdev", "driver=throttle,node-name=thr,throttle-group=tg,file=thr-q"]
    d = common.Daemon(args, binary=binary, tag=f"bc-{tag}")
    out = []
    try:
        q = d.qmp()

        def c(cmd, **a):
            what = os.path.basename(a.get("target", a.get("job-id", ""))).replace(tag, "T")
            out.append((cmd, what, clean(q.cmd_raw(cmd, a))))

        def backup(job, target, **a):
            c("blockdev-backup", **{"job-id": job, "device": "src", "target": target,
                                    "sync": "full", "compress": True, **a})

        # Refused: neither a protocol node nor a raw image takes compressed writes.
        backup("r1", "rawf")
        backup("r2", "rawfmt")
        out.append(("refusal events", job_events(q)))
        for name, _ in TARGETS:
            backup(name, name)
            wait_done(q, name, out)
        # Into a target that holds data where the source has some: EIO, as QEMU.
        backup("u", "used")
        wait_done(q, "u", out, failing=True)
        c("blockdev-create", **{"job-id": "mk", "options": {
            "driver": "qcow2", "file": "cf", "size": SIZE, **CREATE}})
        wait_status(q, "mk", "concluded")
        shutil.copy(created, common.path(f"bc-{tag}-created-new.qcow2"))
        c("job-dismiss", id="mk")
        out.append(("events", "mk", job_events(q)))
        c("blockdev-add", driver="qcow2", **{"node-name": "created"}, file="cf")
        backup("cr", "created")
        wait_done(q, "cr", out)
        # drive-backup shares the path: the image it makes (qcow2, zlib) gets it.
        c("drive-backup", **{"job-id": "dr", "device": "src", "sync": "full",
                             "compress": True, "format": "qcow2",
                             "target": common.path(f"bc-{tag}-drive.qcow2")})
        wait_done(q, "dr", out)
        # mode=existing into a raw file: refused as blockdev-backup's raw targets are.
        c("drive-backup", **{"job-id": "dr2", "device": "src", "sync": "full",
                             "compress": True, "format": "raw", "mode": "existing",
                             "target": raw})
        out.append(("refusal events", job_events(q)))
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    return out


def extents(img):
    """qemu-img map's extents without host offsets, neighbours of one kind merged."""
    m = json.loads(run("qemu-img", "map", "--output=json", img))
    merged = []
    for e in m:
        kind = (e["depth"], e["present"], e["zero"], e["data"], e.get("compressed"))
        if merged and merged[-1][2] == kind and merged[-1][0] + merged[-1][1] == e["start"]:
            merged[-1][1] += e["length"]
        else:
            merged.append([e["start"], e["length"], kind])
    return merged


def check_same(q_img, s_img, src):
    for img in (q_img, s_img):
        run("qemu-img", "check", "-q", img)
        run("qemu-img", "compare", "-q", src, img)
    run("qemu-img", "compare", "-q", q_img, s_img)


def overwrite(q_img, s_img, sock_dir):
    """The same writes into qsd's target with qemu-io, and into stord's through an NBD
    export of stord's: compressed clusters written over, partly and whole."""
    cmds = ["-c", "write -P 0x61 0 4k", "-c", "write -P 0x62 64k 64k",
            "-c", "write -P 0x63 192k 128k", "-c", "write -z 4M 64k",
            "-c", "write -P 0x64 8M 36k"]
    run("qemu-io", *cmds, q_img)
    sock = os.path.join(sock_dir, "bc-ow.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={s_img}",
        "--blockdev", "driver=qcow2,node-name=t,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=e,node-name=t,name=t,writable=on",
    ], tag="bc-ow")
    try:
        q = d.qmp()
        run("qemu-io", "-f", "raw", *cmds, f"nbd+unix:///t?socket={sock}")
        common.quit_and_wait(d, q)
    finally:
        d.stop()


def freed_cluster_not_packed_into():
    """A host cluster that compressed clusters shared, freed once they are all written
    over and then handed out whole to a normal cluster, takes no more compressed data:
    the next compressed cluster goes elsewhere. (qsd 10.0 packs it into that data
    cluster's tail, as QEMU forgets nothing of where it packed last, and its image
    fails qemu-img check: this flow is stord's alone.)"""
    size = 1 << 20
    s1, s2, t = (common.path(f"bc-reuse-{n}.qcow2") for n in ("s1", "s2", "t"))
    for p in (s1, s2, t):
        qcow2_target(p, "compression_type=zlib", size)
    run("qemu-io", "-c", "write -P 0x11 0 256k", s1)
    sock = common.path("bc-reuse.sock")
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=s1f,filename={s1}",
        "--blockdev", "driver=qcow2,node-name=s1,file=s1f",
        "--blockdev", f"driver=file,node-name=s2f,filename={s2}",
        "--blockdev", "driver=qcow2,node-name=s2,file=s2f",
        "--blockdev", f"driver=file,node-name=tf,filename={t}",
        "--blockdev", "driver=qcow2,node-name=t,file=tf",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=et,node-name=t,name=t,writable=on",
        "--export", "type=nbd,id=es2,node-name=s2,name=s2,writable=on",
    ], tag="bc-reuse")
    try:
        q = d.qmp()
        bb = {"sync": "full", "compress": True}
        # Four compressed clusters packed into one host cluster.
        ok(q.cmd_raw("blockdev-backup", {"job-id": "a", "device": "s1", "target": "t", **bb}))
        wait_status(q, "a", "gone")
        tu = f"nbd+unix:///t?socket={sock}"
        # All four written over: the host cluster is freed at the flush, and the next
        # data cluster takes it.
        run("qemu-io", "-f", "raw", "-c", "write -P 0x22 0 256k", "-c", "flush", tu)
        run("qemu-io", "-f", "raw", "-c", "write -P 0x33 512k 64k", "-c", "flush", tu)
        # More compressed clusters, into what the target has not got yet.
        ok(q.cmd_raw("block-dirty-bitmap-add", {"node": "s2", "name": "b"}))
        run("qemu-io", "-f", "raw", "-c", "write -P 0x44 768k 256k",
            f"nbd+unix:///s2?socket={sock}")
        ok(q.cmd_raw("blockdev-backup", {"job-id": "b", "device": "s2", "target": "t", **bb,
                                         "sync": "bitmap", "bitmap": "b",
                                         "bitmap-mode": "never"}))
        wait_status(q, "b", "gone")
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", t)
    out = run("qemu-io", "-c", "read -P 0x22 0 256k", "-c", "read -P 0 256k 256k",
              "-c", "read -P 0x33 512k 64k", "-c", "read -P 0 576k 192k",
              "-c", "read -P 0x44 768k 256k", t)
    assert "Pattern verification failed" not in out, out
    tail = [e for e in extents(t) if e[0] == 768 << 10]
    assert tail and tail[0][2] == (0, True, False, True, True), extents(t)


def killed_mid_backup(src):
    """stord killed with SIGKILL while a compressed backup runs into an image of 4 KiB
    clusters whose table caches hold two tables (so tables are written back all along):
    the image may leak clusters, and nothing worse (qemu-img check: 0 or 3)."""
    rnd = random.Random(5757)
    for i in range(3):
        t = common.path(f"bc-kill-{i}.qcow2")
        qcow2_target(t, "compression_type=zlib,cluster_size=4096")
        d = common.Daemon([
            "--blockdev", f"driver=file,node-name=sf,filename={src}",
            "--blockdev", "driver=qcow2,node-name=src,file=sf,read-only=on",
            "--blockdev", f"driver=file,node-name=tf,filename={t}",
            "--blockdev", "driver=qcow2,node-name=t,file=tf,l2-cache-size=8192,"
                          "refcount-cache-size=8192",
        ], tag="bc-kill")
        try:
            q = d.qmp()
            ok(q.cmd_raw("blockdev-backup", {"job-id": "k", "device": "src", "target": "t",
                                             "sync": "full", "compress": True,
                                             "speed": 8 << 20}))
            q.close()
            time.sleep(0.3 + 0.7 * rnd.random())
            d.proc.kill()
            d.proc.wait()
        finally:
            d.stop()
        r = subprocess.run(["qemu-img", "check", t], capture_output=True, text=True)
        assert r.returncode in (0, 3), r.stdout + r.stderr


def test():
    src = common.path("bc-source.qcow2")
    make_source(src)
    ref = common.path("bc-ref.qcow2")
    qcow2_target(ref, CREATE_IMG)
    theirs = flow("qemu-storage-daemon", "qsd", src)
    ours = flow(common.STORD, "stord", src)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    assert "error" in [r for r in ours if r[0] == "blockdev-backup" and r[1] == "rawf"][0][2]
    failed = [e for r in ours if r[0] == "events" and r[1] == "u" for e in r[2]
              if e[0] == "BLOCK_JOB_COMPLETED"]
    assert failed and failed[0][1].get("error"), failed
    # blockdev-create's image is qemu-img's, byte for byte, in both daemons.
    for tag in ("qsd", "stord"):
        run("cmp", ref, common.path(f"bc-{tag}-created-new.qcow2"))
    q_imgs, s_imgs = targets("qsd"), targets("stord")
    for extra in ("created", "drive"):
        q_imgs[extra] = common.path(f"bc-qsd-{extra}.qcow2")
        s_imgs[extra] = common.path(f"bc-stord-{extra}.qcow2")
    for name in q_imgs:
        check_same(q_imgs[name], s_imgs[name], src)
        q_map, s_map = extents(q_imgs[name]), extents(s_imgs[name])
        assert q_map == s_map, f"{name}\nqsd   {q_map}\nstord {s_map}"
        kinds = {e[2] for e in s_map}
        assert (0, True, False, True, True) in kinds, (name, s_map)
        # The noise is written uncompressed (but where a cluster holds zeroes after it).
        noise = [e for e in s_map if e[0] <= 1 << 20 < e[0] + e[1]]
        compressed = name == "extl2"
        assert noise[0][2] == (0, True, False, True, compressed), (name, noise)
    # Overwritten: stord drops the shared host clusters' references as QEMU does.
    for name in ("zlib", "small", "extl2"):
        overwrite(q_imgs[name], s_imgs[name], common.WORKDIR)
        run("qemu-img", "check", "-q", s_imgs[name])
        run("qemu-img", "compare", "-q", q_imgs[name], s_imgs[name])
        assert extents(q_imgs[name]) == extents(s_imgs[name]), name
    freed_cluster_not_packed_into()
    killed_mid_backup(src)


if __name__ == "__main__":
    common.main(test)
