"""Inactive nodes, as QEMU's tests/qsd-migrate uses them, on stord and qsd side by side:
two daemons on one qcow2 image (the source active, the destination opened with
active=off), each with an NBD export made with allow-inactive=on. The destination cannot
activate while the source holds the image; the source goes inactive (its writes refused,
its reads served), the destination goes active and sees the source's data and writes;
`qemu-img check` finds the image clean. Every return and error, and the `active` field
of query-named-block-nodes at each step, are the same on both daemons."""

import os
import subprocess

import common
from common import ok

QSD = "qemu-storage-daemon"


def qemu_io(sock, cmd):
    uri = f"nbd+unix:///disk-fmt?socket={sock}"
    r = subprocess.run(["qemu-io", "-f", "raw", "-c", cmd, uri],
                       capture_output=True, text=True)
    return r.returncode == 0 and "failed" not in r.stdout + r.stderr, r.stdout + r.stderr


def actives(q):
    nodes = ok(q.cmd_raw("query-named-block-nodes"))
    return sorted((n["node-name"], n["active"]) for n in nodes)


def flow(binary, tag):
    img = common.path(f"{tag}-migrate.qcow2")
    if os.path.exists(img):
        os.unlink(img)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", img, "10M"], check=True)
    seen = []
    socks = {side: common.path(f"{tag}-{side}-nbd.sock") for side in ("src", "dst")}

    def daemon(side, active):
        off = "" if active else ",active=off"
        return common.Daemon([
            "--blockdev", f"file,node-name=disk-file,filename={img}{off}",
            "--blockdev", f"qcow2,file=disk-file,node-name=disk-fmt{off}",
            "--nbd-server", f"addr.type=unix,addr.path={socks[side]}",
            "--export", "nbd,id=exp0,node-name=disk-fmt,writable=true,allow-inactive=true",
        ], binary=binary, tag=f"{tag}-{side}")

    src = daemon("src", True)
    dst = daemon("dst", False)
    try:
        qs, qd = src.qmp(), dst.qmp()
        assert qemu_io(socks["src"], "write -P 0x11 0 4k")[0]
        seen.append(("src", actives(qs)))
        seen.append(("dst", actives(qd)))
        # The source holds the image: the destination cannot take it.
        r = qd.cmd_raw("blockdev-set-active", {"active": True})
        seen.append(("dst activate early", r.get("error", {}).get("class"), "error" in r))
        seen.append(("dst after refusal", actives(qd)))
        seen.append(("bad node", qs.cmd_raw("blockdev-set-active",
                                            {"node-name": "nope", "active": False})))
        seen.append(("child first", qs.cmd_raw("blockdev-set-active",
                                               {"node-name": "disk-file", "active": False})))
        seen.append(("src inactivate", qs.cmd_raw("blockdev-set-active", {"active": False})))
        seen.append(("src", actives(qs)))
        seen.append(("src reads", qemu_io(socks["src"], "read -P 0x11 0 4k")[0]))
        seen.append(("src writes", qemu_io(socks["src"], "write -P 0x33 0 4k")[0]))
        seen.append(("dst activate", qd.cmd_raw("blockdev-set-active", {"active": True})))
        seen.append(("dst", actives(qd)))
        seen.append(("dst reads", qemu_io(socks["dst"], "read -P 0x11 0 4k")[0]))
        seen.append(("dst writes", qemu_io(socks["dst"], "write -P 0x22 0 4k")[0]))
        qs.close()
        qd.close()
    finally:
        src.stop()
        dst.stop()
    check = subprocess.run(["qemu-img", "check", img], capture_output=True, text=True)
    seen.append(("check", check.returncode, "No errors were found" in check.stdout))
    seen.append(("data", qemu_io_file(img)))
    return seen


def qemu_io_file(img):
    r = subprocess.run(["qemu-io", "-f", "qcow2", "-c", "read -P 0x22 0 4k", img],
                       capture_output=True, text=True)
    return r.returncode == 0 and "failed" not in r.stdout + r.stderr


def test():
    theirs = flow(QSD, "qsd")
    ours = flow(common.STORD, "stord")
    assert ours == theirs, "\n".join(f"{a!r}\n  qsd:   {b!r}" for a, b in zip(ours, theirs))
    # What the flow must show, beyond the two daemons agreeing.
    d = dict((s[0], s[1:]) for s in ours)
    assert d["dst activate early"][1], ours
    assert d["src reads"] == (True,) and d["src writes"] == (False,), ours
    assert d["dst reads"] == (True,) and d["dst writes"] == (True,), ours
    assert d["check"] == (0, True) and d["data"] == (True,), ours


common.main(test)
