"""Internal snapshots of a qcow2 image an NBD export serves (Proxmox's qcow2 snapshots),
the same flow against qsd and stord: blockdev-snapshot-internal-sync between guest writes
(QEMU's refusals first), one in a transaction that aborts, duplicate names, and
blockdev-snapshot-delete-internal-sync by name and by id.

Every return and error equal to qsd's (the snapshot's dates masked); afterwards
qemu-img check is clean, `qemu-img snapshot -l` lists the same ids and names, and QEMU
reads each snapshot and the active image of stord's image as those of qsd's, byte for
byte."""

import json
import os

import common
from common import ok, run

SIZE = 32 << 20



def masked(r):
    """A reply without the times a snapshot records (they differ between two runs)."""
    if isinstance(r.get("return"), dict):
        r = dict(r, **{"return": {k: v for k, v in r["return"].items()
                                  if k not in ("date-sec", "date-nsec", "vm-clock-sec",
                                               "vm-clock-nsec")}})
    return r


def flow(binary, tag, base):
    disk = common.path(f"is-{tag}.qcow2")
    run("cp", base, disk)
    ro = common.path(f"is-{tag}-ro.qcow2")
    common.qcow2(ro, SIZE)
    raw = common.path(f"is-{tag}.raw")
    with open(raw, "wb") as f:
        f.truncate(SIZE)
    sock = common.path(f"is-{tag}.sock")
    out = []
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={disk}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--blockdev", f"driver=file,node-name=rof,filename={ro},read-only=on",
        "--blockdev", "driver=qcow2,node-name=ro,file=rof,read-only=on",
        "--blockdev", f"driver=file,node-name=rawf,filename={raw}",
        "--blockdev", "driver=raw,node-name=rawn,file=rawf",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
    ], binary=binary, tag=tag)
    live = f"nbd+unix:///live?socket={sock}"
    try:
        q = d.qmp()

        def c(cmd, **a):
            out.append((cmd, a, masked(q.cmd_raw(cmd, a))))

        snap = lambda dev, name: c("blockdev-snapshot-internal-sync", device=dev, name=name)
        delete = lambda dev="disk", **a: c("blockdev-snapshot-delete-internal-sync",
                                           device=dev, **a)
        snap("nowhere", "s")
        snap("f", "s")
        snap("ro", "s")
        snap("rawn", "s")
        snap("disk", "")
        snap("disk", "s1")
        run("qemu-io", "-f", "raw", "-c", "write -P 0x21 0 1M", "-c", "write -P 0x22 5M 64k",
            "-c", "write -z 8M 128k", live)
        snap("disk", "s2")
        snap("disk", "s1")
        c("transaction", actions=[
            {"type": "blockdev-snapshot-internal-sync", "data": {"device": "disk",
                                                                 "name": "s3"}},
            {"type": "abort", "data": {}}])
        run("qemu-io", "-f", "raw", "-c", "write -P 0x31 512k 1M", "-c", "discard 8M 64k",
            live)
        snap("disk", "s3")
        delete()
        delete(name="nope")
        delete(id="9")
        delete(id="1", name="s2")
        delete(name="s1")
        run("qemu-io", "-f", "raw", "-c", "write -P 0x41 4M 2M", live)
        delete(id="3")
        snap("disk", "s4")
        run("qemu-io", "-f", "raw", "-c", "write -P 0x51 4M 64k", live)
        common.quit_and_wait(d, q)
    finally:
        d.stop()
    run("qemu-img", "check", "-q", disk)
    snaps = json.loads(run("qemu-img", "info", "--output=json", disk)).get("snapshots", [])
    out.append(("snapshots", [(s["id"], s["name"], s["vm-state-size"]) for s in snaps]))
    images = {}
    for s in snaps:
        dst = common.path(f"is-{tag}-{s['name']}.raw")
        run("qemu-img", "convert", "-O", "raw", "-l", f"snapshot.name={s['name']}", disk, dst)
        images[s["name"]] = dst
    active = common.path(f"is-{tag}-active.raw")
    run("qemu-img", "convert", "-O", "raw", disk, active)
    images["active"] = active
    return out, images


def test():
    base = common.path("is-base.qcow2")
    common.qcow2(base, SIZE)
    run("qemu-io", "-c", "write -P 0x11 0 8M", "-c", "write -P 0x12 20M 1M",
        "-c", "write -c -P 0x13 24M 64k", base)
    theirs, t_images = flow("qemu-storage-daemon", "qsd", base)
    ours, o_images = flow(common.STORD, "stord", base)
    for a, b in zip(theirs, ours):
        assert a == b, f"\nqsd   {a}\nstord {b}"
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    assert sorted(t_images) == sorted(o_images) and len(o_images) == 3, o_images
    for name in o_images:
        run("qemu-img", "compare", "-f", "raw", "-F", "raw", t_images[name], o_images[name])
    # The snapshots differ from each other and from the active image.
    sizes = {open(p, "rb").read() for p in o_images.values()}
    assert len(sizes) == 3
    assert os.path.getsize(o_images["active"]) == SIZE


if __name__ == "__main__":
    common.main(test)
