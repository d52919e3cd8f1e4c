"""Helpers for the QMP tests: start stord (or qsd) and talk to it with qemu.qmp."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from qemu.qmp.legacy import QEMUMonitorProtocol

STORD = os.environ.get("STORD_BIN", "stord")
WORKDIR = os.environ.get("STORD_TEST_DIR", "/tmp")


def path(name):
    return os.path.join(WORKDIR, name)


class Daemon:
    """A stord (or qemu-storage-daemon) process with a QMP monitor on a unix socket."""

    def __init__(self, args, binary=STORD, tag="stord"):
        self.qmp_path = path(f"{tag}-qmp.sock")
        self.pidfile = path(f"{tag}.pid")
        for p in (self.qmp_path, self.pidfile):
            if os.path.exists(p):
                os.unlink(p)
        full = [binary,
                "--chardev", f"socket,id=mon0,path={self.qmp_path},server=on,wait=off",
                "--monitor", "chardev=mon0",
                "--pidfile", self.pidfile] + list(args)
        self.proc = subprocess.Popen(full, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 15
        while not os.path.exists(self.pidfile):
            if self.proc.poll() is not None:
                raise AssertionError(f"{binary} exited: {self.proc.stderr.read()}")
            if time.time() > deadline:
                raise AssertionError(f"{binary} did not start")
            time.sleep(0.01)

    def qmp(self):
        q = QEMUMonitorProtocol(self.qmp_path)
        q.connect(negotiate=True)
        return q

    def signal(self, sig):
        self.proc.send_signal(sig)

    def wait(self, timeout=15):
        return self.proc.wait(timeout=timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ok(resp):
    """The 'return' of a response, asserting it is not an error."""
    assert "return" in resp, f"expected success, got {resp}"
    return resp["return"]


def err(resp, cls="GenericError", contains=None):
    assert "error" in resp, f"expected an error, got {resp}"
    assert resp["error"]["class"] == cls, resp
    if contains:
        assert contains in resp["error"]["desc"], resp
    return resp["error"]["desc"]


def sparse(name, size):
    p = path(name)
    with open(p, "wb") as f:
        f.truncate(size)
    return p


def run(*args):
    """A command that must succeed: its standard output."""
    return subprocess.run(list(args), check=True, capture_output=True, text=True).stdout


def quit_and_wait(d, q):
    """QMP `quit`, then the daemon's clean exit (it may be gone before the client hangs
    up)."""
    ok(q.cmd_raw("quit"))
    try:
        q.close()
    except EOFError:
        pass
    assert d.wait() == 0


def qcow2(image, size, backing=None):
    """A fresh qcow2 image, backed by `backing` (named relative to it) if given."""
    if os.path.exists(image):
        os.unlink(image)
    args = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing:
        args += ["-b", os.path.basename(backing), "-F", "qcow2"]
    subprocess.run(args + [image, str(size)], check=True)


def apply_dirty(src, dst, extents):
    """Copies the extents an nbdinfo map marks dirty from file `src` onto file `dst` (an
    incremental backup restored onto the full one)."""
    with open(src, "rb") as s, open(dst, "r+b") as d:
        for e in extents:
            if e["type"] & 1:
                s.seek(e["offset"])
                d.seek(e["offset"])
                d.write(s.read(e["length"]))


def fio(*args, check=True):
    # --verify_state_save=0: no *-verify.state files left in the working directory.
    out = subprocess.run(["fio", "--output-format=json", "--verify_state_save=0"] + list(args),
                         capture_output=True, text=True)
    if check:
        assert out.returncode == 0, f"fio failed: {out.stdout}{out.stderr}"
    try:
        return json.loads(out.stdout[out.stdout.index("{"):])
    except ValueError:
        return None


def wait_event(q, name, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        ev = q.pull_event(wait=max(0.01, deadline - time.time()))
        if ev and ev["event"] == name:
            return ev
    raise AssertionError(f"no {name} event within {timeout}s")


def unexport(q, export_id):
    """block-export-del, then its BLOCK_EXPORT_DELETED event. qsd may still count an NBD
    client that has just hung up as a user: it is asked again for up to 5 s."""
    deadline = time.time() + 5
    while True:
        r = q.cmd_raw("block-export-del", {"id": export_id})
        if "error" not in r or "still in use" not in r["error"]["desc"] \
                or time.time() > deadline:
            break
        time.sleep(0.05)
    ok(r)
    wait_event(q, "BLOCK_EXPORT_DELETED")


def blockdev_del(q, node):
    """blockdev-del, asked again for up to 5 s while the node is still in use (an export
    just deleted may still be letting its last client go)."""
    deadline = time.time() + 5
    while True:
        r = q.cmd_raw("blockdev-del", {"node-name": node})
        if "error" not in r or "in use" not in r["error"]["desc"] or time.time() > deadline:
            break
        time.sleep(0.05)
    ok(r)


def raw_monitor(sock_path):
    """A raw socket past capabilities negotiation, for input qemu.qmp would not send."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    f = s.makefile("rwb")
    greeting = json.loads(f.readline())
    assert "QMP" in greeting
    f.write(b'{"execute": "qmp_capabilities"}\n')
    f.flush()
    assert "return" in json.loads(f.readline())
    return s, f


def main(test):
    try:
        test()
    except AssertionError:
        import traceback
        traceback.print_exc()
        sys.exit(1)
    print("PASS")
