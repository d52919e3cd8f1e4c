"""QMP monitors made and removed at run time: QEMU 11.1's `monitor-qmp` object
(qapi/qom.json's MonitorQMPProperties: `chardev`, `pretty`, `close-action`), with the
flows of QEMU's own functional test for it (tests/functional/generic/
test_monitor_hotplug.py): add a chardev and a monitor on it, connect, negotiate, run a
command, unplug, and again with the same ids and path; a client cannot delete its own
monitor (another can); `close-action=delete` removes the monitor and its chardev once the
client hangs up; a monitor without it takes reconnects; a large reply and events reach it.

qsd 10.0 has no such object (it refuses the type); its `pretty=on` monitor is the
reference for what a `pretty=on` monitor-qmp sends, byte for byte."""

import json
import os
import socket
import time

import common
from common import ok, err

from qemu.qmp.legacy import QEMUMonitorProtocol


def add_monitor(q, sock, **props):
    ok(q.cmd_raw("chardev-add", {"id": "hotplug-chr", "backend": {"type": "socket", "data": {
        "addr": {"type": "unix", "data": {"path": sock}}, "server": True, "wait": False}}}))
    ok(q.cmd_raw("object-add", dict({"qom-type": "monitor-qmp", "id": "hotplug-mon",
                                     "chardev": "hotplug-chr"}, **props)))


def remove_monitor(q):
    ok(q.cmd_raw("object-del", {"id": "hotplug-mon"}))
    ok(q.cmd_raw("chardev-remove", {"id": "hotplug-chr"}))


def handshake(sock):
    c = QEMUMonitorProtocol(sock)
    greeting = c.connect(negotiate=True)
    assert "version" in greeting["QMP"] and "capabilities" in greeting["QMP"], greeting
    assert "qemu" in c.cmd_obj({"execute": "query-version"})["return"]
    return c


def labels(q):
    return [c["label"] for c in ok(q.cmd_raw("query-chardev"))]


def objects(q):
    return [o["name"] for o in ok(q.cmd_raw("qom-list", {"path": "/objects"}))]


def complete(reply):
    """Whether `reply` holds one whole JSON reply and its line end (a pretty reply has
    inner lines that end in a brace too, so a read can stop at one of them)."""
    if not reply.endswith(b"\r\n"):
        return False
    try:
        json.loads(reply)
        return True
    except ValueError:
        return False


def raw_exchange(sock, commands):
    """What a monitor sends, byte for byte, for `commands` (the greeting left out)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(5)
    data = b""
    while not complete(data):
        data += s.recv(65536)
    got = []
    for cmd in commands:
        s.sendall(json.dumps(cmd).encode() + b"\n")
        reply = b""
        while not complete(reply):
            reply += s.recv(65536)
        got.append(reply)
    s.close()
    return got


PRETTY_COMMANDS = [{"execute": "qmp_capabilities"},
                   {"execute": "block-export-del", "arguments": {"id": "nope"}},
                   {"execute": "query-block-exports"}]


def qsd_reference():
    """qsd 10.0: it has no monitor-qmp type; what its `pretty=on` monitor sends."""
    sock = common.path("mo-qsd-pretty.sock")
    d = common.Daemon(["--chardev", f"socket,id=p,path={sock},server=on,wait=off",
                       "--monitor", "chardev=p,pretty=on"],
                      binary="qemu-storage-daemon", tag="qsd")
    try:
        q = d.qmp()
        refused = q.cmd_raw("object-add", {"qom-type": "monitor-qmp", "id": "m",
                                           "chardev": "mon0"})
        q.close()
        return refused, raw_exchange(sock, PRETTY_COMMANDS)
    finally:
        d.stop()


def test():
    refused, pretty = qsd_reference()
    assert "error" in refused and "monitor-qmp" in refused["error"]["desc"], refused
    sock = common.path("mo-hotplug.sock")
    d = common.Daemon([])
    try:
        q = d.qmp()
        # The hotplug cycle, twice with the same ids and path.
        for _ in range(2):
            add_monitor(q, sock)
            handshake(sock).close()
            remove_monitor(q)
        assert not os.path.exists(sock)
        # A client cannot delete its own monitor; another can.
        add_monitor(q, sock)
        c = handshake(sock)
        r = c.cmd_obj({"execute": "object-del", "arguments": {"id": "hotplug-mon"}})
        assert "error" in r, r
        ok(c.cmd_obj({"execute": "query-version"}))
        ok(q.cmd_raw("object-del", {"id": "hotplug-mon"}))
        # Its client is disconnected; the chardev stays.
        served = True
        try:
            c.cmd_obj({"execute": "query-version"})
        except Exception:  # the client library's own error for a lost connection
            served = False
        assert not served, "the client of a deleted monitor is still served"
        assert "hotplug-chr" in labels(q) and "hotplug-mon" not in objects(q)
        ok(q.cmd_raw("chardev-remove", {"id": "hotplug-chr"}))
        # close-action=delete: gone with the client, its chardev too.
        add_monitor(q, sock, **{"close-action": "delete"})
        assert "hotplug-chr" in labels(q) and "hotplug-mon" in objects(q)
        props = ok(q.cmd_raw("qom-list-get", {"paths": ["/objects/hotplug-mon"]}))
        values = {p["name"]: p.get("value") for p in props[0]["properties"]}
        assert values == {"type": "monitor-qmp", "chardev": "hotplug-chr", "pretty": False,
                          "close-action": "delete"}, values
        c = handshake(sock)
        assert "hotplug-mon" in objects(q)
        c.close()
        deadline = time.time() + 10
        while "hotplug-chr" in labels(q) and time.time() < deadline:
            time.sleep(0.05)
        assert "hotplug-chr" not in labels(q) and "hotplug-mon" not in objects(q)
        # Without it: reconnects; a large reply; events after negotiation.
        add_monitor(q, sock)
        for _ in range(2):
            c = handshake(sock)
            schema = c.cmd_obj({"execute": "query-qmp-schema"})["return"]
            assert isinstance(schema, list) and len(schema) > 100
            c.close()
        c = handshake(sock)
        ok(q.cmd_raw("blockdev-add", {"driver": "null-co", "node-name": "n"}))
        ok(q.cmd_raw("nbd-server-start", {"addr": {"type": "unix", "data": {
            "path": common.path("mo-nbd.sock")}}}))
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e", "node-name": "n"}))
        ok(q.cmd_raw("block-export-del", {"id": "e"}))
        ev = c.pull_event(wait=5)
        assert ev["event"] == "BLOCK_EXPORT_DELETED" and ev["data"]["id"] == "e", ev
        c.close()
        remove_monitor(q)
        # pretty=on: what qsd's pretty monitor sends, byte for byte.
        add_monitor(q, sock, pretty=True)
        got = raw_exchange(sock, PRETTY_COMMANDS)
        assert got == pretty, (got, pretty)
        remove_monitor(q)
        # QEMU's refusals: no chardev, an unknown one, one another monitor uses.
        add = lambda **p: q.cmd_raw("object-add", dict({"qom-type": "monitor-qmp",
                                                         "id": "m2"}, **p))
        err(add(), contains="arameter 'chardev' is missing")
        err(add(chardev="nope"), contains='chardev "nope" not found')
        err(add(chardev="mon0"), contains="Device 'mon0' is in use")
        err(add(chardev="mon0", **{"close-action": "later"}))
        assert "m2" not in objects(q)
        q.close()
    finally:
        d.stop()

    # On the command line, as --object.
    sock = common.path("mo-cl.sock")
    d = common.Daemon(["--chardev", f"socket,id=c1,path={sock},server=on,wait=off",
                       "--object", "monitor-qmp,id=m1,chardev=c1"], tag="stord-cl")
    try:
        handshake(sock).close()
        q = d.qmp()
        assert "m1" in objects(q)
        ok(q.cmd_raw("object-del", {"id": "m1"}))
        q.close()
    finally:
        d.stop()


common.main(test)
