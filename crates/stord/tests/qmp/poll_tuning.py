"""qom-set changes the live loop's polling: query-iothreads shows it, and the statistics
move accordingly under I/O. The loop threads run with the scheduler slice they were made with."""

import os
import threading

import common
from common import ok, err


def iothread(q):
    [t] = ok(q.cmd_raw("query-iothreads"))
    return t


def slice_ns(pid, tid):
    """The slice the kernel runs a thread with (its /proc sched file)."""
    with open(f"/proc/{pid}/task/{tid}/sched") as f:
        [line] = [l for l in f if l.startswith("se.slice")]
    return int(line.split()[-1])


def load(uri, seconds=1):
    common.fio("--name=l", "--ioengine=nbd", f"--uri={uri}", "--rw=randread", "--bs=4k",
               "--iodepth=1", "--time_based", f"--runtime={seconds}", "--size=16M")


def test():
    nbd = common.path("poll-nbd.sock")
    d = common.Daemon(["--object", "iothread,id=io0,poll-max-ns=0",
                       "--blockdev", "driver=null-co,node-name=n0,size=16777216",
                       "--nbd-server", f"addr.type=unix,addr.path={nbd}",
                       "--export", "type=nbd,id=e0,node-name=n0,name=n0,iothread=io0"])
    uri = f"nbd+unix:///n0?socket={nbd}"
    try:
        q = d.qmp()
        t = iothread(q)
        assert t["poll-max-ns"] == 0 and t["poll-policy"] == "adaptive", t
        assert t["x-stats"]["reactor"] in ("io_uring", "epoll"), t
        assert isinstance(t["thread-id"], int) and t["thread-id"] > 0
        assert ok(q.cmd_raw("qom-get", {"path": "/objects/io0", "property": "poll-max-ns"})) == 0

        # Polling off: I/O makes the loop block, never poll.
        before = iothread(q)["x-stats"]
        load(uri)
        after = iothread(q)["x-stats"]
        assert after["iterations"] > before["iterations"], (before, after)
        assert after["polls-attempted"] == before["polls-attempted"], (before, after)
        assert after["blocking-waits"] > before["blocking-waits"]

        # Turn polling on (a window larger than fio's think time): on io_uring the loop
        # polls the ring and catches the requests without blocking. (On the epoll
        # fallback, socket readiness is not visible in memory, so, as in QEMU with epoll,
        # fd-driven work never polls: the loop keeps blocking.)
        ok(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-max-ns", "value": 2000000}))
        assert iothread(q)["poll-max-ns"] == 2000000
        before = iothread(q)["x-stats"]
        load(uri)
        after = iothread(q)["x-stats"]
        if after["reactor"] == "io_uring":
            assert after["polls-attempted"] > before["polls-attempted"], (before, after)
            assert after["poll-hits"] > before["poll-hits"], (before, after)
            assert after["poll-ns"] > before["poll-ns"]
            ring = [w for w in after["windows"] if w["name"] == "io_uring"]
            assert ring and ring[0]["ns"] > 0, after["windows"]
            # The default policy shows whether it polls as a context-wide window.
            assert "(context)" in [w["name"] for w in after["windows"]], after["windows"]
        else:
            assert after["blocking-waits"] > before["blocking-waits"], (before, after)

        # Weighted policy with a weight: visible in query-iothreads and in the windows.
        ok(q.cmd_raw("qom-set", {"path": "io0", "property": "poll-weight", "value": 2}))
        ok(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-policy", "value": "weighted"}))
        t = iothread(q)
        assert t["poll-weight"] == 2 and t["poll-policy"] == "weighted", t
        load(uri)
        names = [w["name"] for w in iothread(q)["x-stats"]["windows"]]
        assert "(context)" in names, names
        assert ok(q.cmd_raw("qom-get", {"path": "/objects/io0", "property": "poll-policy"})) == "weighted"

        # Wrong values are refused and change nothing.
        err(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-weight", "value": 64}),
            contains="poll-weight")
        err(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-max-ns", "value": "fast"}),
            contains="expected: integer")
        err(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-policy", "value": "turbo"}),
            contains="turbo")
        err(q.cmd_raw("qom-set", {"path": "/objects/io0", "property": "poll-max-ns", "value": 2**63}),
            contains="poll-max-ns must be in 0..=1000000000")
        err(q.cmd_raw("object-add", {"qom-type": "iothread", "id": "big", "poll-max-ns": 2**63}),
            contains="0..=1000000000")
        err(q.cmd_raw("qom-get", {"path": "/objects/nope", "property": "poll-max-ns"}), cls="DeviceNotFound")
        assert iothread(q)["poll-weight"] == 2

        # The loop threads ask the scheduler for a short slice (the main loop's too); an
        # iothread made with another runs with that one, and slices the kernel would clamp
        # are refused.
        pid = d.proc.pid
        assert slice_ns(pid, t["thread-id"]) == 100000
        assert slice_ns(pid, pid) == 100000
        assert ok(q.cmd_raw("qom-get", {"path": "/objects/io0", "property": "sched-slice-ns"})) == 100000
        ok(q.cmd_raw("object-add", {"qom-type": "iothread", "id": "io1", "sched-slice-ns": 250000}))
        [t1] = [t for t in ok(q.cmd_raw("query-iothreads")) if t["id"] == "io1"]
        assert slice_ns(pid, t1["thread-id"]) == 250000
        assert ok(q.cmd_raw("qom-get", {"path": "io1", "property": "sched-slice-ns"})) == 250000
        # 0: the kernel's default (what this script runs with), not the main loop's slice
        # that the thread would otherwise inherit.
        ok(q.cmd_raw("object-add", {"qom-type": "iothread", "id": "io3", "sched-slice-ns": 0}))
        [t3] = [t for t in ok(q.cmd_raw("query-iothreads")) if t["id"] == "io3"]
        assert slice_ns(pid, t3["thread-id"]) == slice_ns(os.getpid(), threading.get_native_id())
        err(q.cmd_raw("object-add", {"qom-type": "iothread", "id": "io2", "sched-slice-ns": 5000}),
            contains="sched-slice-ns must be 0 or in 100000..=100000000")
        q.close()
    finally:
        d.stop()


common.main(test)
