"""driver=nbd, the NBD client node: the same flows against qsd and stord, with qemu-nbd as
the server each daemon's node connects to.

- blockdev-add's refusals (no server, a refused connection, an unknown export, a read-only
  export opened writable, an x-dirty-bitmap the server lacks) and block_resize (grow
  refused, shrink a no-op), with QEMU's texts and classes; the node's query entry.
- fio verify (nbd engine, many requests in flight) through an NBD export of the node, and
  through a FUSE export of it on stord; block status passes through (qemu-img map of the
  export equals the server's); nbdcopy of the export equals the server's file.
- qcow2 over an nbd node (qemu-nbd serving the qcow2 file's bytes): a persistent bitmap,
  fio verify, then the same pattern written by qemu-io on both; qemu-img check clean, the
  bitmap stored, images compare-identical.
- The server killed: with reconnect-delay=0 a read fails with EIO at once while another
  export keeps serving, and works again once the server is back; with reconnect-delay=10,
  fio verify writes across a kill and restart of the server with no error.
- x-dirty-bitmap=qemu:dirty-bitmap:b0 over qemu-nbd -B: qemu-img map of the export
  shows the ranges written since the bitmap was added as not data, as on qsd.
- A server with a 4 KiB minimum block that refuses smaller requests (nbdkit
  blocksize-policy): sub-block writes, zeroes and reads work and read back; fio verify of
  512-byte writes at QD16 passes (read-modify-write of shared blocks serialised).
- stord's x-multi-conn=4: four connections to a server that offers multi-conn, one to a
  server that does not; fio verify across the four; all four back after a restart.
- A server that stalls (SIGSTOP): QMP still answers, another export still serves, and
  SIGTERM still stops stord (after its 10 s flush limit; qsd 10.0 waits for the server).
  On stord, a node with x-request-timeout=2 (stord's option; QEMU's client waits forever)
  fails a read with EIO after 2 to 4 s."""

import json
import os
import signal
import subprocess
import threading
import time

import common
from common import ok

SIZE = 64 << 20


class Server:
    """qemu-nbd serving `image` (as raw bytes) on a unix socket, restartable."""

    def __init__(self, tag, name, image, read_only=False, shared=8):
        self.sock = common.path(f"nc-{tag}-{name}.sock")
        self.image = image
        self.read_only = read_only
        self.shared = shared
        self.proc = None
        self.start()

    def start(self):
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        # More than one client at a time also offers multi-conn.
        args = ["qemu-nbd", "-f", "raw", "-x", "exp", "-k", self.sock, "-e",
                str(self.shared), "-t"]
        if self.read_only:
            args.append("-r")
        self.proc = subprocess.Popen(args + [self.image], stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while not os.path.exists(self.sock):
            assert time.time() < deadline, "qemu-nbd did not listen"
            time.sleep(0.01)

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def server(self):
        return {"type": "unix", "path": self.sock}

    def clients(self):
        """Connected clients: the server's sockets besides its listening one."""
        fds = os.listdir(f"/proc/{self.proc.pid}/fd")
        return sum(os.readlink(f"/proc/{self.proc.pid}/fd/{f}").startswith("socket:")
                   for f in fds) - 1


def raw_image(tag, name, size=SIZE):
    p = common.path(f"nc-{tag}-{name}.raw")
    with open(p, "wb") as f:
        f.truncate(size)
    subprocess.run(["qemu-io", "-f", "raw", "-c", "write -P 0x3c 1M 2M", "-c",
                    "write -P 0x7e 40M 64k", p], check=True, capture_output=True)
    return p


def uri(tag, name):
    return f"nbd+unix:///{name}?socket={common.path(f'nc-{tag}-exp.sock')}"


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


def refusals(q, tag):
    out = []
    d = common.path
    ro = Server(tag, "ro", raw_image(tag, "ro"), read_only=True)
    srv = Server(tag, "err", raw_image(tag, "err"))
    cases = [
        {"server": {"type": "unix", "path": d("nc-nope.sock")}, "export": "exp"},
        {"server": {"type": "inet", "host": "127.0.0.1", "port": "1"}, "export": "exp"},
        {"server": srv.server(), "export": "zzz"},
        {"server": ro.server(), "export": "exp"},
        {"server": srv.server(), "export": "exp", "x-dirty-bitmap": "qemu:dirty-bitmap:b"},
    ]
    for c in cases:
        r = q.cmd_raw("blockdev-add", dict(driver="nbd", **{"node-name": "bad"}, **c))
        out.append(r.get("error", r))
    # Read-only, it opens; the node is read-only.
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "ro", "read-only": True,
                                  "server": ro.server(), "export": "exp"}))
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "n", "server": srv.server(),
                                  "export": "exp"}))
    out.append(q.cmd_raw("block_resize", {"node-name": "n", "size": SIZE * 2}))
    out.append(q.cmd_raw("block_resize", {"node-name": "n", "size": SIZE // 2}))
    for n in q.cmd_raw("query-named-block-nodes")["return"]:
        if n["node-name"] in ("n", "ro"):
            # children: QEMU 10.1's, which the installed qsd 10.0 lacks (block_nodes.py).
            n = {k: v for k, v in n.items() if k not in ("file", "image", "children")}
            out.append(n)
    entry = [n for n in q.cmd_raw("query-named-block-nodes")["return"] if n["node-name"] == "n"]
    assert entry[0]["file"] == f"nbd+unix:///exp?socket={srv.sock}", entry
    assert entry[0]["image"]["virtual-size"] == SIZE, entry
    common.blockdev_del(q, "n")
    common.blockdev_del(q, "ro")
    ro.kill()
    srv.kill()
    # Only our own names carry the daemon's tag (the test directory's name may hold one too).
    return [json.dumps(x, sort_keys=True).replace(f"nc-{tag}-", "nc-TAG-") for x in out]


def start(binary, tag):
    d = common.Daemon(["--object", "iothread,id=io0", "--nbd-server",
                       f"addr.type=unix,addr.path={common.path(f'nc-{tag}-exp.sock')}"],
                      binary=binary, tag=tag)
    return d, d.qmp()


def data_paths(q, tag, stord):
    """fio verify through exports of an nbd node; the server's file ends up as read."""
    disk = raw_image(tag, "disk")
    srv = Server(tag, "disk", disk)
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "disk",
                                  "server": srv.server(), "export": "exp"}))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk",
                                      "name": "disk", "writable": True, "iothread": "io0"}))
    fio_verify(nbd_target(tag, "disk"), "8M")
    # Larger and odd requests, reads and writes mixed.
    fio_verify(nbd_target(tag, "disk"), "20M", "16M", ("--bsrange=512-2M", "--rw=randrw"))
    if stord:
        mnt = common.path(f"nc-{tag}-fuse")
        open(mnt, "w").close()
        ok(q.cmd_raw("block-export-add", {"type": "fuse", "id": "f0", "node-name": "disk",
                                          "mountpoint": mnt, "writable": True,
                                          "iothread": ["io0"]}))
        fio_verify(["--ioengine=psync", f"--filename={mnt}", "--direct=1"], "48M", "4M",
                   ("--iodepth=1",))
        common.unexport(q, "f0")
    # Block status passes through: the export's map is the server's.
    m1 = subprocess.run(["qemu-img", "map", "--output=json", "-f", "raw", uri(tag, "disk")],
                        capture_output=True, text=True, check=True).stdout
    m2 = subprocess.run(["qemu-img", "map", "--output=json", "-f", "raw",
                         f"nbd+unix:///exp?socket={srv.sock}"],
                        capture_output=True, text=True, check=True).stdout
    assert m1 == m2, (m1, m2)
    copy = common.path(f"nc-{tag}-copy.raw")
    subprocess.run(["nbdcopy", uri(tag, "disk"), copy], check=True)
    common.unexport(q, "e0")
    common.blockdev_del(q, "disk")
    srv.kill()
    with open(copy, "rb") as a, open(disk, "rb") as b:
        assert a.read() == b.read(), "the export read differs from the server's file"


def dirty_bitmap(q, tag):
    """x-dirty-bitmap: a node reads qemu-nbd's export of a qcow2's persistent bitmap as its
    block status (dirty reads as not data, as in QEMU), which qemu-img map of the daemon's
    export shows: the ranges written since the bitmap was added."""
    image = common.path(f"nc-{tag}-bm.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", image, "64M"], check=True)
    subprocess.run(["qemu-img", "bitmap", "--add", image, "b0"], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write 4M 64k", "-c", "write 20M 1M",
                    image], check=True, capture_output=True)
    sock = common.path(f"nc-{tag}-bm.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    srv = subprocess.Popen(["qemu-nbd", "-r", "-f", "qcow2", "-B", "b0", "-x", "exp", "-k",
                            sock, "-t", image], stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not os.path.exists(sock):
        assert time.time() < deadline, "qemu-nbd did not listen"
        time.sleep(0.01)
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "bm", "read-only": True,
                                  "server": {"type": "unix", "path": sock}, "export": "exp",
                                  "x-dirty-bitmap": "qemu:dirty-bitmap:b0"}))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "bm", "node-name": "bm",
                                      "name": "bm", "iothread": "io0"}))
    m = subprocess.run(["qemu-img", "map", "--output=json", "-f", "raw", uri(tag, "bm")],
                       capture_output=True, text=True, check=True)
    dirty = [(e["start"], e["length"]) for e in json.loads(m.stdout) if not e["data"]]
    print(tag, "dirty per x-dirty-bitmap:", dirty, flush=True)
    common.unexport(q, "bm")
    common.blockdev_del(q, "bm")
    srv.kill()
    srv.wait()
    return dirty


def min_block(q, tag):
    """A server that refuses requests smaller than its 4 KiB minimum block (nbdkit's
    blocksize-policy filter, error policy): sub-block writes, zeroes and reads through the
    node are done in whole blocks (read-modify-write), so they succeed and read back; on
    stord, fio verify of 512-byte writes at QD16 (many in one block at once) finds every
    write."""
    sock = common.path(f"nc-{tag}-mb.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    srv = subprocess.Popen(["nbdkit", "-f", "-U", sock, "--filter=blocksize-policy", "memory",
                            "64M", "blocksize-minimum=4096", "blocksize-error-policy=error"],
                           stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not os.path.exists(sock):
        assert time.time() < deadline, "nbdkit did not listen"
        time.sleep(0.01)
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "mb",
                                  "server": {"type": "unix", "path": sock}}))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "mb", "node-name": "mb",
                                      "name": "mb", "writable": True, "iothread": "io0"}))
    out = {}
    r = qemu_io_uri(uri(tag, "mb"), "write -P 0x11 100 512", "write -P 0x22 5000 10000",
                    "write -z 30001 9000", "discard 70000 5000")
    out["sub-block writes"] = r.returncode == 0 and "error" not in r.stdout
    r = qemu_io_uri(uri(tag, "mb"), "read -P 0 0 100", "read -P 0x11 100 512",
                    "read -P 0 612 4388", "read -P 0x22 5000 10000",
                    "read -P 0 30001 9000")
    out["read back"] = r.returncode == 0 and "fail" not in r.stdout + r.stderr
    if tag == "stord":
        # qsd's export passes the 4 KiB minimum on to its clients, and libnbd then refuses
        # 512-byte requests itself; stord's takes any size.
        res = fio_verify(nbd_target(tag, "mb"), "1M", "2M", ("--bs=512",))
        out["fio verify, 512-byte writes"] = res["jobs"][0]["error"] == 0
    common.unexport(q, "mb")
    common.blockdev_del(q, "mb")
    srv.kill()
    srv.wait()
    print(tag, "min block:", out, flush=True)
    return out


def multi_conn(q, tag):
    """stord's x-multi-conn: four connections where the server allows several (one where
    it does not), data verified across them, and all four back after a server restart."""
    out = {}
    disk = raw_image(tag, "mc")
    srv = Server(tag, "mc", disk)
    single = Server(tag, "mc1", raw_image(tag, "mc1"), shared=1)
    for node, s in (("mc", srv), ("mc1", single)):
        ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": node, "server": s.server(),
                                      "export": "exp", "x-multi-conn": 4,
                                      "reconnect-delay": 10}))
    out["four connections"] = srv.clients() == 4
    out["one where multi-conn is not offered"] = single.clients() == 1
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "mc", "node-name": "mc",
                                      "name": "mc", "writable": True, "iothread": "io0"}))
    res = fio_verify(nbd_target(tag, "mc"), "4M", "16M", ("--bsrange=512-256k", "--rw=randrw"))
    out["fio verify over four"] = res["jobs"][0]["error"] == 0
    srv.kill()
    srv.start()
    r = qemu_io_uri(uri(tag, "mc"), "read -P 0x3c 1M 64k")
    out["read after the restart"] = r.returncode == 0 and "error" not in r.stdout
    deadline = time.time() + 10
    while srv.clients() != 4 and time.time() < deadline:
        time.sleep(0.1)
    out["four again"] = srv.clients() == 4
    common.unexport(q, "mc")
    for node in ("mc", "mc1"):
        common.blockdev_del(q, node)
    srv.kill()
    single.kill()
    print(tag, "multi-conn:", out, flush=True)
    return out


def qcow2_over_nbd(q, tag):
    image = common.path(f"nc-{tag}-q.qcow2")
    if os.path.exists(image):
        os.unlink(image)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(SIZE)], check=True)
    # An NBD export cannot grow: the qcow2 file gets room for its clusters up front, as
    # on a block device.
    os.truncate(image, SIZE + (16 << 20))
    srv = Server(tag, "q", image)
    ok(q.cmd_raw("blockdev-add", {"driver": "qcow2", "node-name": "q",
                                  "file": {"driver": "nbd", "server": srv.server(),
                                           "export": "exp"}}))
    # A persistent bitmap: its table goes into the image at close, after what the
    # refcounts count, not past the export's end.
    ok(q.cmd_raw("block-dirty-bitmap-add", {"node": "q", "name": "b0", "persistent": True}))
    ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "eq", "node-name": "q",
                                      "name": "q", "writable": True, "iothread": "io0"}))
    fio_verify(nbd_target(tag, "q"), "4M")
    # The same bytes on both daemons' images (fio's verify headers carry timestamps).
    r = qemu_io_uri(uri(tag, "q"), "write -P 0x61 0 16M", "write -z 24M 1M",
                    "write -P 0x62 60M 64k", "discard 2M 1M")
    assert r.returncode == 0 and "error" not in r.stdout, r
    common.unexport(q, "eq")
    common.blockdev_del(q, "q")
    srv.kill()
    subprocess.run(["qemu-img", "check", "-q", image], check=True)
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", image],
                                     capture_output=True, text=True, check=True).stdout)
    bitmaps = info["format-specific"]["data"].get("bitmaps", [])
    assert [b["name"] for b in bitmaps] == ["b0"], info
    return image


def faults(q, tag):
    """The server killed and restarted, with and without reconnect-delay."""
    out = []
    disk = raw_image(tag, "f")
    srv = Server(tag, "f", disk)
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "f0", "server": srv.server(),
                                  "export": "exp"}))
    ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "f10", "server": srv.server(),
                                  "export": "exp", "reconnect-delay": 10}))
    ok(q.cmd_raw("blockdev-add", {"driver": "null-co", "node-name": "other",
                                  "size": 1 << 20}))
    for n in ("f0", "f10", "other"):
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": n, "node-name": n, "name": n,
                                          "writable": True, "iothread": "io0"}))
    srv.kill()
    r = qemu_io_uri(uri(tag, "f0"), "read -P 0x3c 1M 64k")
    out.append(("f0 read, server gone", "Input/output error" in r.stdout + r.stderr))
    r = qemu_io_uri(uri(tag, "other"), "read 0 64k")
    out.append(("other export", r.returncode == 0 and "error" not in r.stdout))
    srv.start()
    deadline = time.time() + 10
    while True:
        r = qemu_io_uri(uri(tag, "f0"), "read -P 0x3c 1M 64k")
        if r.returncode == 0 and "error" not in r.stdout and "fail" not in r.stdout:
            break
        assert time.time() < deadline, f"no reconnect: {r}"
        time.sleep(0.2)
    out.append(("f0 read, server back", True))

    # reconnect-delay=10: writes wait across the kill and go on after the restart.
    def bounce():
        time.sleep(1.0)
        srv.kill()
        time.sleep(2.0)
        srv.start()
    t = threading.Thread(target=bounce)
    t.start()
    res = fio_verify(nbd_target(tag, "f10"), "16M", "16M",
                     ("--iodepth=4", "--rate_iops=2000"))
    t.join()
    out.append(("f10 fio across the restart", res["jobs"][0]["error"] == 0))

    if tag == "stord":
        # stord's own option: a request unanswered for 2 s gives the connection up.
        ok(q.cmd_raw("blockdev-add", {"driver": "nbd", "node-name": "ft",
                                      "server": srv.server(), "export": "exp",
                                      "x-request-timeout": 2}))
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "ft", "node-name": "ft",
                                          "name": "ft", "writable": True,
                                          "iothread": "io0"}))
    # A stalled server: QMP answers, another export serves.
    srv.proc.send_signal(signal.SIGSTOP)
    stalled = subprocess.Popen(["qemu-io", "-f", "raw", "-c", "read 0 4k", uri(tag, "f0")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    t0 = time.time()
    ok(q.cmd_raw("query-block-exports"))
    out.append(("QMP answers while stalled", time.time() - t0 < 2))
    r = qemu_io_uri(uri(tag, "other"), "read 0 64k")
    out.append(("other export while stalled", r.returncode == 0 and "error" not in r.stdout))
    timed_out = None
    if tag == "stord":
        # With x-request-timeout=2 a read on the stalled server fails with EIO in 2-4 s.
        t0 = time.time()
        r = qemu_io_uri(uri(tag, "ft"), "read 0 4k")
        took = time.time() - t0
        print(tag, f"read with x-request-timeout=2 on a stalled server: {took:.1f} s",
              r.stdout.strip(), r.stderr.strip(), flush=True)
        timed_out = "Input/output error" in r.stdout + r.stderr and 1.5 < took < 5
    return out, srv, stalled, timed_out


def run(binary, tag):
    stord = tag == "stord"
    d, q = start(binary, tag)
    rec = {"refusals": refusals(q, tag)}
    print(tag, "refusals done", flush=True)
    data_paths(q, tag, stord)
    print(tag, "data paths done", flush=True)
    rec["dirty bitmap"] = dirty_bitmap(q, tag)
    mb = min_block(q, tag)
    rec["min block"] = {k: v for k, v in mb.items() if not k.startswith("fio")}
    rec_mb = mb
    if stord:
        rec_mc = multi_conn(q, tag)
    image = qcow2_over_nbd(q, tag)
    print(tag, "qcow2 done", flush=True)
    rec["faults"], srv, stalled, timed_out = faults(q, tag)
    print(tag, "faults done", flush=True)
    # SIGTERM with a request stuck on the stalled server: the daemon still stops.
    # (qsd 10.0 does not: it waits for the request; it is killed after 15 s.)
    t0 = time.time()
    d.signal(signal.SIGTERM)
    try:
        d.wait(timeout=30 if stord else 15)
        stopped = True
    except subprocess.TimeoutExpired:
        stopped = False
        d.proc.kill()
    print(tag, "SIGTERM with a stalled server:",
          f"stopped in {time.time() - t0:.1f} s" if stopped else "still running, killed")
    srv.proc.send_signal(signal.SIGCONT)
    srv.kill()
    stalled.kill()
    return rec, image, stopped, (timed_out, rec_mc if stord else None, rec_mb)


def test():
    qsd, qsd_image, _, _ = run("qemu-storage-daemon", "qsd")
    st, st_image, stopped, (timed_out, mc, mb) = run(common.STORD, "stord")
    assert all(mc.values()), mc
    assert all(mb.values()) and len(mb) == 3, mb
    # qcow2's bitmap granularity is 64 KiB: exactly the two ranges written.
    assert st["dirty bitmap"] == [(4 << 20, 64 << 10), (20 << 20, 1 << 20)], st
    assert timed_out, "a read on a stalled server did not time out with x-request-timeout"

    for k in qsd:
        assert qsd[k] == st[k], f"{k}:\n qsd   {qsd[k]}\n stord {st[k]}"
    assert all(v for _, v in st["faults"]), st["faults"]
    assert stopped, "stord did not stop on SIGTERM with a stalled server"
    r = subprocess.run(["qemu-img", "compare", "-q", qsd_image, st_image])
    assert r.returncode == 0, "the qcow2 images over nbd differ"


if __name__ == "__main__":
    common.main(test)
