"""A chardev's log: ChardevCommon's `logfile` and `logappend`, side by side with qsd 10.0,
and QEMU 11.0's `logtimestamp`, against QEMU's chardev/char.c (each line of the log
starts with the UTC time GLib's ISO 8601 form gives, fraction of a second included when
not zero, then a space; the bytes are the same as without it).

- ringbufs made on the command line and with chardev-add create, truncate or append to
  their logs as qsd does; ringbuf-write's bytes are not logged (QEMU writes them into the
  ring past the chardev layer);
- a monitor's chardev logs what the monitor sends (its replies; the greeting's version
  left aside): the same bytes qsd's log holds;
- qsd 10.0 refuses `logtimestamp`; stord's timestamped log is the plain log with each
  line's time in front, times within the test's run."""

import datetime
import json
import re
import socket
import time

import common
from common import ok, err

WRITES = [("first line\nsecond ", None), ("line\n", None), ("dGhpcmQK", "base64"),
          ("open end", None)]
COMMANDS = [{"execute": "qmp_capabilities"}, {"execute": "block-export-del",
                                              "arguments": {"id": "nope"}},
            {"execute": "query-block-exports"}, {"execute": "nope"}]


def read(p):
    with open(p, "rb") as f:
        return f.read()


def talk(sock):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(5)
    f = s.makefile("rwb")
    f.readline()
    for c in COMMANDS:
        f.write(json.dumps(c).encode() + b"\n")
        f.flush()
        f.readline()
    s.close()


def flow(binary, tag, stamped):
    logs = {k: common.path(f"cl-{tag}-{k}.log") for k in ("cl", "qmp", "mon")}
    with open(logs["qmp"], "wb") as f:
        f.write(b"kept\n")
    sock = common.path(f"cl-{tag}.sock")
    stamp = ",logtimestamp=on" if stamped else ""
    d = common.Daemon([
        "--chardev", f"ringbuf,id=r1,logfile={logs['cl']}{stamp}",
        "--chardev", f"socket,id=m1,path={sock},server=on,wait=off,logfile={logs['mon']}"
                     f"{stamp}",
        "--monitor", "chardev=m1",
    ], binary=binary, tag=tag)
    out = []
    try:
        q = d.qmp()
        data = {"logfile": logs["qmp"], "logappend": True}
        if stamped:
            data["logtimestamp"] = True
        out.append(q.cmd_raw("chardev-add", {"id": "r2", "backend": {
            "type": "ringbuf", "data": data}}))
        out.append(q.cmd_raw("chardev-add", {"id": "bad", "backend": {
            "type": "null", "data": {"logfile": common.path("no/such/dir/x.log")}}}))
        for dev in ("r1", "r2"):
            for text, fmt in WRITES:
                args = {"device": dev, "data": text}
                if fmt:
                    args["format"] = fmt
                out.append(q.cmd_raw("ringbuf-write", args))
        talk(sock)
        q.close()
    finally:
        d.stop()
    return out, {k: read(p) for k, p in logs.items()}


def unstamp(text, t0, t1):
    """The log without each line's time; the times checked against [t0, t1]."""
    out = []
    pattern = re.compile(rb"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?)Z (.*)", re.S)
    for line in text.split(b"\n"):
        if not line:
            out.append(line)
            continue
        m = pattern.fullmatch(line)
        assert m, line
        when = datetime.datetime.fromisoformat(m.group(1).decode()).replace(
            tzinfo=datetime.timezone.utc).timestamp()
        assert t0 - 1 <= when <= t1 + 1, (m.group(1), t0, t1)
        out.append(m.group(2))
    return b"\n".join(out)


def test():
    theirs, their_logs = flow("qemu-storage-daemon", "qsd", False)
    ours, our_logs = flow(common.STORD, "stord", False)
    assert theirs == ours, (theirs, ours)
    assert "Could not create" in ours[1]["error"]["desc"], ours[1]
    assert their_logs["cl"] == our_logs["cl"] == b"", (their_logs["cl"], our_logs["cl"])
    assert their_logs["qmp"] == our_logs["qmp"] == b"kept\n", their_logs["qmp"]
    # The monitor's log: its replies, byte for byte (the greeting's version differs).
    mine = our_logs["mon"].split(b"\r\n", 1)
    theirs_mon = their_logs["mon"].split(b"\r\n", 1)
    assert mine[0].startswith(b'{"QMP": ') and theirs_mon[0].startswith(b'{"QMP": ')
    assert mine[1] == theirs_mon[1], (mine[1], theirs_mon[1])

    # logtimestamp: qsd 10.0 has none; stord's is the plain log with times in front.
    d = common.Daemon([], binary="qemu-storage-daemon", tag="qsd-ts")
    try:
        q = d.qmp()
        err(q.cmd_raw("chardev-add", {"id": "r", "backend": {"type": "ringbuf", "data": {
            "logfile": common.path("cl-qsd-ts.log"), "logtimestamp": True}}}),
            contains="logtimestamp")
        q.close()
    finally:
        d.stop()
    t0 = time.time()
    stamped, stamped_logs = flow(common.STORD, "stord-ts", True)
    t1 = time.time()
    assert stamped == ours, stamped
    assert unstamp(stamped_logs["mon"], t0, t1) == our_logs["mon"], stamped_logs["mon"]
    assert stamped_logs["cl"] == b"" and stamped_logs["qmp"] == b"kept\n", stamped_logs


common.main(test)
