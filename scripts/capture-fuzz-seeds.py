#!/usr/bin/env python3
"""Captures fuzz seeds from real traffic: what libnbd (nbdinfo), QEMU (qemu-img, qemu-io),
fio's nbd engine and the qemu.qmp library send to stord, recorded by a relay between them
and a stord serving a null node, plus qcow2 headers that qemu-img writes and the option
strings of qsd's manual. Writes fuzz/corpus/<target>/seed-*; run by hand when the protocols
or clients change (the seeds are committed).

    python3 scripts/capture-fuzz-seeds.py [path/to/stord]
"""

import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def save(target, data, name):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    h = hashlib.sha1(data).hexdigest()[:12]
    with open(os.path.join(d, f"seed-{name}-{h}"), "wb") as f:
        f.write(data)


class Relay:
    """Listens on `front`, forwards each connection to `back`, records what clients send."""

    def __init__(self, front, back):
        self.front, self.back = front, back
        self.streams = []
        self.lock = threading.Lock()
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(front)
        self.srv.listen(16)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            s = socket.socket(socket.AF_UNIX)
            s.connect(self.back)
            rec = bytearray()
            with self.lock:
                self.streams.append(rec)
            threading.Thread(target=self.pump, args=(c, s, rec), daemon=True).start()
            threading.Thread(target=self.pump, args=(s, c, None), daemon=True).start()

    @staticmethod
    def forward(src, dst):
        """Moves one read's worth from `src` to `dst`; returns the bytes (empty at end)."""
        b = src.recv(65536)
        if b:
            dst.sendall(b)
        return b

    def pump(self, src, dst, rec):
        try:
            while True:
                b = self.forward(src, dst)
                if not b:
                    break
                if rec is not None:
                    rec.extend(b)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def take(self):
        time.sleep(0.2)
        with self.lock:
            out = [bytes(s) for s in self.streams]
            self.streams.clear()
        return out


class FdRelay(Relay):
    """A relay that also forwards descriptors (SCM_RIGHTS), for vhost-user."""

    @staticmethod
    def forward(src, dst):
        data, fds, _, _ = socket.recv_fds(src, 65536, 64)
        if data:
            socket.send_fds(dst, [data], fds)
        for fd in fds:
            os.close(fd)
        return data


def libblkio_helper():
    """The libblkio client helper of the vhost-user-blk tests (built if needed)."""
    out = subprocess.run(["cargo", "test", "-p", "stord", "--test", "vhost_user_blk_libblkio",
                          "--no-run", "--message-format=json"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    import json
    for line in out.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and \
                "vhost_user_blk_libblkio" in m["executable"]:
            return m["executable"]
    raise SystemExit("no vhost_user_blk_libblkio test binary")


def split_handshake(stream):
    """(negotiation bytes, transmission bytes): options until GO or EXPORT_NAME."""
    pos = 4
    while pos + 16 <= len(stream):
        opt = int.from_bytes(stream[pos + 8:pos + 12], "big")
        length = int.from_bytes(stream[pos + 12:pos + 16], "big")
        pos += 16 + length
        if opt in (1, 7):
            return stream[:pos], stream[pos:]
    return stream, b""


def run(*cmd, **kw):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)


def main():
    stord = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target/debug/stord")
    tmp = tempfile.mkdtemp(prefix="stord-seeds-")
    nbd_sock, qmp_sock = os.path.join(tmp, "nbd.sock"), os.path.join(tmp, "qmp.sock")
    daemon = subprocess.Popen([
        stord,
        "--blockdev", "driver=null-co,node-name=disk,size=64M,read-zeroes=on",
        "--nbd-server", f"addr.type=unix,addr.path={nbd_sock}",
        "--export", "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,allocation-depth=on",
        "--chardev", f"socket,id=m,path={qmp_sock},server=on,wait=off",
        "--monitor", "chardev=m",
    ], stderr=subprocess.DEVNULL)
    try:
        while not (os.path.exists(nbd_sock) and os.path.exists(qmp_sock)):
            time.sleep(0.01)
        front = os.path.join(tmp, "front.sock")
        relay = Relay(front, nbd_sock)
        uri = f"nbd+unix:///disk?socket={front}"
        clients = {
            "nbdinfo": [["nbdinfo", "--list", f"nbd+unix://?socket={front}"],
                        ["nbdinfo", "--map", uri],
                        ["nbdinfo", "--map=qemu:allocation-depth", uri]],
            "qemu-img": [["qemu-img", "map", "--output=json", "-f", "raw", uri],
                         ["qemu-io", "-f", "raw", "-c", "write -P 7 0 64k", "-c", "read 0 64k",
                          "-c", "write -z 1M 1M", "-c", "discard 2M 64k", "-c", "flush", uri]],
            "fio": [["fio", "--name=s", "--ioengine=nbd", f"--uri={uri}", "--rw=randrw",
                     "--bs=4k", "--iodepth=8", "--size=4M", "--io_size=256k",
                     "--verify_state_save=0", "--output=/dev/null"]],
        }
        for who, cmds in clients.items():
            for cmd in cmds:
                run(*cmd)
            for i, stream in enumerate(relay.take()):
                hs, tx = split_handshake(stream)
                save("nbd_handshake", hs, f"{who}{i}")
                if tx:
                    # Structured replies: every client here negotiates them.
                    save("nbd_transmission", b"\x01" + tx[:60000], f"{who}{i}")

        # QMP: what qemu.qmp sends for a session of the commands stord has.
        qfront = os.path.join(tmp, "qfront.sock")
        qrelay = Relay(qfront, qmp_sock)
        from qemu.qmp.legacy import QEMUMonitorProtocol
        q = QEMUMonitorProtocol(qfront)
        q.connect(negotiate=True)
        for cmd, args in [
            ("query-version", None), ("query-commands", None), ("query-iothreads", None),
            ("object-add", {"qom-type": "iothread", "id": "io1", "poll-max-ns": 32768}),
            ("qom-set", {"path": "/objects/io1", "property": "poll-grow", "value": 2}),
            ("blockdev-add", {"driver": "null-co", "node-name": "n2", "size": 1048576}),
            ("query-named-block-nodes", None), ("query-block-exports", None),
            ("block-export-add", {"type": "nbd", "id": "e2", "node-name": "n2"}),
            ("block-export-del", {"id": "e2"}), ("object-del", {"id": "io1"}),
            ("transaction", {"actions": [{"type": "abort", "data": {}}]}),
        ]:
            q.cmd_raw(cmd, args)
        q.close()
        for i, stream in enumerate(qrelay.take()):
            save("qmp_stream", b"\x40" + stream, f"qemu-qmp{i}")
            save("qmp_commands", stream, f"qemu-qmp{i}")
    finally:
        daemon.terminate()
        daemon.wait()

    # vhost-user: what libblkio sends (connect, memory regions, vrings, then requests),
    # through a relay that forwards its descriptors, for half a second.
    img = os.path.join(tmp, "vhost.img")
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    vsock = os.path.join(tmp, "vhost.sock")
    daemon = subprocess.Popen([
        stord, "--object", "iothread,id=io0",
        "--blockdev", f"driver=file,node-name=disk,filename={img}",
        "--export", f"type=vhost-user-blk,id=v,node-name=disk,addr.type=unix,"
                    f"addr.path={vsock},writable=on,iothread=io0",
    ], stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(vsock):
            time.sleep(0.01)
        vfront = os.path.join(tmp, "vfront.sock")
        vrelay = FdRelay(vfront, vsock)
        child = subprocess.Popen(
            [libblkio_helper(), "--exact", "blkio_child_writes_until_killed", "--ignored"],
            env=dict(os.environ, STORD_TEST_BLKIO_CHILD_SOCK=vfront),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        child.kill()
        child.wait()
        for i, stream in enumerate(vrelay.take()):
            save("vhost_user_messages", stream[:60000], f"libblkio{i}")
    finally:
        daemon.terminate()
        daemon.wait()

    # virtio-blk chains and FUSE requests: made here (no capture point between a guest or
    # the kernel and stord), in the layouts the fuzz entries take.
    def desc(addr, length, flags, nxt):
        return (addr.to_bytes(8, "little") + length.to_bytes(4, "little")
                + flags.to_bytes(2, "little") + nxt.to_bytes(2, "little"))

    for name, kind, data_flags in [("read", 0, 3), ("write", 1, 1), ("flush", 4, 1)]:
        mem = bytearray(32 << 10)
        table = 0x100
        mem[table:table + 48] = (desc(0x1000, 16, 1, 1) + desc(0x2000, 4096, data_flags, 2)
                                 + desc(0x4000, 1, 2, 0))
        mem[0x1000:0x1010] = kind.to_bytes(4, "little") + bytes(4) + (8).to_bytes(8, "little")
        save("virtio_blk_chain", (0).to_bytes(2, "little") + (8).to_bytes(2, "little")
             + table.to_bytes(4, "little") + bytes(mem), name)

    def fuse(opcode, unique, body):
        return ((40 + len(body)).to_bytes(4, "little") + opcode.to_bytes(4, "little")
                + unique.to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(16) + body)

    init = (7).to_bytes(4, "little") + (31).to_bytes(4, "little") + bytes(56)
    rw = (0).to_bytes(8, "little") + (4096).to_bytes(8, "little") + (4096).to_bytes(4, "little")
    save("fuse_requests", fuse(26, 1, init) + fuse(3, 2, bytes(16)) + fuse(15, 3, rw + bytes(20))
         + fuse(16, 4, rw + bytes(20) + b"\xab" * 4096) + fuse(20, 5, bytes(16)), "session")

    # qcow2 headers as qemu-img writes them.
    for name, opts in [("v3", []), ("v2", ["-o", "compat=0.10"]),
                       ("lazy", ["-o", "lazy_refcounts=on"]),
                       ("extl2", ["-o", "extended_l2=on"]),
                       ("zstd", ["-o", "compression_type=zstd"]),
                       ("refcount1", ["-o", "refcount_bits=1"]),
                       ("small-clusters", ["-o", "cluster_size=512"])]:
        img = os.path.join(tmp, f"{name}.qcow2")
        run("qemu-img", "create", "-f", "qcow2", *opts, img, "64M")
        with open(img, "rb") as f:
            save("qcow2_header", f.read(65536), name)
    base = os.path.join(tmp, "base.qcow2")
    top = os.path.join(tmp, "top.qcow2")
    run("qemu-img", "create", "-f", "qcow2", base, "64M")
    run("qemu-io", "-c", "write -c 0 64k", base)
    run("qemu-img", "create", "-f", "qcow2", "-b", base, "-F", "qcow2", top)
    run("qemu-io", "-c", "write 64k 64k", top)
    for name, img in [("compressed", base), ("backing", top)]:
        with open(img, "rb") as f:
            save("qcow2_header", f.read(65536), name)

    # LUKS headers as qemu-img writes them: a default one (the header alone), and an
    # AES-128-CBC one with slot 0's material and few iterations, which the fuzz entry
    # unlocks with its password ("fuzz").
    for name, opts, keep in [
            ("aes256-xts-header", "", 592),
            ("aes128-cbc-unlockable", ",cipher-alg=aes-128,cipher-mode=cbc", 4096 + 16 * 4000)]:
        img = os.path.join(tmp, f"{name}.luks")
        run("qemu-img", "create", "-f", "luks", "--object", "secret,id=s,data=fuzz",
            "-o", f"key-secret=s,iter-time=1{opts}", img, "1M")
        with open(img, "rb") as f:
            save("luks_header", f.read(keep), f"qemu-img-{name}")

    # Option strings from qemu-storage-daemon(1) and stord's README.
    for i, s in enumerate([
        "iothread,id=iothread0,poll-max-ns=65536,poll-grow=2",
        "driver=file,node-name=file,filename=disk.qcow2,aio=io_uring,cache.direct=on",
        "driver=qcow2,node-name=qcow2,file=file",
        "type=nbd,id=export,node-name=qcow2,name=disk,writable=on,iothread.0=a,iothread.1=b",
        "addr.type=unix,addr.path=/tmp/nbd.sock,max-connections=4",
        "tls-creds-x509,id=tls0,endpoint=server,dir=/etc/pki/qemu,verify-peer=on",
        "authz-simple,id=auth0,identity=CN=laptop.example.com,,O=Example Org,,C=GB",
        '{"driver": "qcow2", "node-name": "q", "file": {"driver": "file", "filename": "x"}}',
        "driver=null-co,node-name=n,size=1G,read-zeroes=on",
        "throttle-group,id=g,x-iops-total=1000,x-iops-total-max=2000",
    ]):
        save("keyval", s.encode(), f"manual{i}")
    save("psk_keys", b"alice:0123456789abcdef0123456789abcdef\nbob:00ff\n", "psktool")
    print("seeds written under", CORPUS)


main()
