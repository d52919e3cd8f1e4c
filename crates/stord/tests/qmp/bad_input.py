"""Malformed JSON, unknown commands, wrong argument types and a 10 MB message: each gets an
error (or closes only its own connection) and the daemon keeps answering elsewhere."""

import json
import socket

import common
from common import ok, err


def reply(f):
    while True:
        m = json.loads(f.readline())
        if "event" not in m:
            return m


def test():
    d = common.Daemon([])
    try:
        watcher = d.qmp()
        s, f = common.raw_monitor(d.qmp_path)
        for bad in [b'{"execute": }\n', b'this is not json\n', b'[1, 2, 3]\n', b'"just a string"\n']:
            f.write(bad)
            f.flush()
            m = reply(f)
            assert m["error"]["class"] == "GenericError", (bad, m)
        # The connection is still usable, and ids are echoed.
        f.write(b'{"execute": "query-version", "id": "abc"}\n')
        f.flush()
        m = reply(f)
        assert m["id"] == "abc" and "return" in m, m
        # Unknown command, unknown member, wrong argument types.
        f.write(b'{"execute": "no-such-command", "id": 7}\n')
        f.flush()
        m = reply(f)
        assert m["error"]["class"] == "CommandNotFound" and m["id"] == 7, m
        f.write(b'{"execute": "query-version", "bogus": 1}\n')
        f.flush()
        assert "error" in reply(f)
        f.write(b'{"execute": "blockdev-add", "arguments": {"driver": "null-co", "node-name": 5}}\n')
        f.flush()
        m = reply(f)
        assert "Invalid parameter type for 'node-name'" in m["error"]["desc"], m
        f.write(b'{"execute": "block-export-del", "arguments": {"id": "x", "mode": 3}}\n')
        f.flush()
        assert "error" in reply(f)
        f.write(b'{"execute": "query-version", "arguments": {"extra": true}}\n')
        f.flush()
        assert "unexpected" in reply(f)["error"]["desc"]

        # Before negotiation only qmp_capabilities is accepted.
        s2 = socket.socket(socket.AF_UNIX)
        s2.connect(d.qmp_path)
        f2 = s2.makefile("rwb")
        json.loads(f2.readline())
        f2.write(b'{"execute": "query-version"}\n')
        f2.flush()
        assert json.loads(f2.readline())["error"]["class"] == "CommandNotFound"
        s2.close()

        # A 10 MB message closes that connection only.
        big = b'{"execute": "query-version", "arguments": {"x": "' + b"a" * (10 << 20) + b'"}}\n'
        try:
            s.sendall(big)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(10)
        closed = False
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
        except (ConnectionResetError, socket.timeout):
            closed = True
        assert closed, "oversized message did not close the connection"
        s.close()

        # Everyone else is still served.
        assert "qemu" in ok(watcher.cmd_raw("query-version"))
        q = d.qmp()
        ok(q.cmd_raw("query-block-exports"))
        err(q.cmd_raw("qmp_capabilities"), cls="CommandNotFound")
        # Malformed arguments of the newer commands: an error each, nothing kept.
        for cmd, args in [
            ("chardev-add", {"id": "c", "backend": 5}),
            ("chardev-add", {"id": "c", "backend": {"type": "ringbuf", "data": {"size": 3}}}),
            ("chardev-add", {"id": "c", "backend": {"type": "ringbuf",
                                                    "data": {"size": 1 << 40}}}),
            ("chardev-add", {"id": "c", "backend": {"type": "socket", "data": {}}}),
            ("ringbuf-write", {"device": "nope", "data": "x", "format": "base64"}),
            ("blockdev-backup", {"device": "x", "target": "y", "sync": "full",
                                 "x-perf": {"max-workers": "many"}}),
            ("blockdev-backup", {"device": "x", "target": "y", "sync": 1}),
            ("block-job-change", {"id": "j", "type": "mirror", "copy-mode": "sideways"}),
            ("x-blockdev-set-iothread", {"node-name": "n", "iothread": 5}),
            ("x-blockdev-amend", {"job-id": "a", "node-name": "n",
                                  "options": {"driver": "qcow2", "encrypt": 7}}),
            ("qom-list", {"path": "/objects/../../x"}),
            ("object-add", {"qom-type": "metrics", "id": "m", "addr": {"type": "vsock"}}),
        ]:
            r = q.cmd_raw(cmd, args)
            assert "error" in r, (cmd, args, r)
        assert ok(q.cmd_raw("query-chardev")) == [
            c for c in ok(q.cmd_raw("query-chardev")) if c["label"] != "c"]
        q.close()
        watcher.close()
        assert d.proc.poll() is None
    finally:
        d.stop()


common.main(test)
