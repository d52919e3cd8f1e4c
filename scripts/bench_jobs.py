#!/usr/bin/env python3
"""Block job speed, stord beside qsd: mirror, stream, commit and backup of 1 GiB whose
every cluster holds data, on this machine's disk (cache.direct=on) and on /dev/shm; the
time from the command to BLOCK_JOB_COMPLETED (a mirror is completed as soon as it is
ready). Runs alternate between the daemons, REPS times (3 by default).

With `--polled`, each job runs again while a second monitor asks query-version and
query-jobs every 5 ms, as management tools poll a job's progress: the job's time beside
its unpolled time, and the monitor's latency percentiles. With `--iothread`, the node the
job copies from is moved to an IoThread first (x-blockdev-set-iothread), where both
daemons then run the job's I/O (mirror only: qsd 10.0 aborts in
bdrv_insert_node when block-stream, block-commit or blockdev-backup starts on a node
moved this way).

With `--poller-nice N` the polling client's thread runs at nice N (root: -15), so that
its own wait for a CPU, when a job keeps every CPU busy, is not counted as the daemon's.

With `--export-load`, the mirror's source is exported over NBD from an IoThread and fio
(nbd engine, 4k random writes, QD16, 5 s) writes through it, once alone and once while a
mirror of it runs (the mirror stays busy copying what fio dirties): the IOPS each time,
and the drop the job causes, beside qsd's.

    python3 scripts/bench_jobs.py [--polled [--poller-nice N]] [--iothread] [--export-load]
                                  [--jobs mirror,stream] [--media disk,tmpfs]
                                  [STORD_BINARY] > results/jobs/jobs-DATE.md
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "crates/stord/tests/qmp"))
import common  # noqa: E402

SIZE = 1 << 30
REPS = int(os.environ.get("REPS", "3"))
MEDIA = {
    "disk": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "bench-jobs"),
    "tmpfs": "/dev/shm/stord-bench-jobs",
}
POLL_INTERVAL = 0.005
POLLER_NICE = None


def qcow2(path, backing=None):
    if os.path.exists(path):
        os.unlink(path)
    args = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing:
        args += ["-b", backing, "-F", "qcow2"]
    subprocess.run(args + [path, str(SIZE)], check=True)


def fill(path):
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x5a 0 {SIZE}", path],
                   check=True, capture_output=True)


def node(name, path, cache, backing=None):
    b = f",backing={backing}" if backing else ""
    return ["--blockdev", f"driver=qcow2,node-name={name},file.driver=file,"
                          f"file.filename={path},file.cache.direct={cache},"
                          f"file.aio=io_uring{b}"]


class Poller(threading.Thread):
    """A second monitor asking query-version and query-jobs every 5 ms; the latency of
    each answer."""

    def __init__(self, sock_path):
        super().__init__(daemon=True)
        self.sock, self.f = common.raw_monitor(sock_path)
        self.stop = threading.Event()
        self.latencies = []

    def ask(self, cmd):
        t0 = time.perf_counter()
        self.f.write(json.dumps({"execute": cmd}).encode() + b"\n")
        self.f.flush()
        while True:
            msg = json.loads(self.f.readline())
            if "return" in msg or "error" in msg:
                break
        self.latencies.append(time.perf_counter() - t0)

    def run(self):
        if POLLER_NICE is not None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POLLER_NICE)
        while not self.stop.is_set():
            self.ask("query-version")
            self.ask("query-jobs")
            time.sleep(POLL_INTERVAL)

    def finish(self):
        self.stop.set()
        self.join()
        self.sock.close()


class Setup:
    """The images of one job kind on one medium: made once, reused by every run."""

    def __init__(self, job, where, direct):
        self.job, self.where = job, where
        self.cache = "on" if direct else "off"
        p = lambda n: os.path.join(where, f"{job}-{n}.qcow2")  # noqa: E731
        self.base, self.mid, self.top = p("base"), p("mid"), p("top")
        if job in ("mirror", "backup"):
            qcow2(self.base)
            fill(self.base)
        elif job == "stream":
            qcow2(self.base)
            fill(self.base)
        elif job == "commit":
            qcow2(self.base)
            qcow2(self.mid, self.base)
            fill(self.mid)
            self.mid_copy = self.mid + ".orig"
            subprocess.run(["cp", "--sparse=always", self.mid, self.mid_copy], check=True)

    def prepare(self):
        """Fresh targets for one run; the daemon's options and the command."""
        c = self.cache
        if self.job in ("mirror", "backup"):
            qcow2(self.top)
            args = node("src", self.base, c) + node("tgt", self.top, c)
            if self.job == "mirror":
                return args, ("blockdev-mirror", {"job-id": "j", "device": "src",
                                                  "target": "tgt", "sync": "full"})
            return args, ("blockdev-backup", {"job-id": "j", "device": "src",
                                              "target": "tgt", "sync": "full"})
        if self.job == "stream":
            qcow2(self.top, self.base)
            args = node("base", self.base, c) + node("top", self.top, c, "base")
            return args, ("block-stream", {"job-id": "j", "device": "top"})
        # commit: mid's data into an empty base, under an empty top.
        qcow2(self.base)
        subprocess.run(["cp", "--sparse=always", self.mid_copy, self.mid], check=True)
        qcow2(self.top, self.mid)
        args = (node("base", self.base, c) + node("mid", self.mid, c, "base")
                + node("top", self.top, c, "mid"))
        return args, ("block-commit", {"job-id": "j", "device": "top", "top-node": "mid",
                                       "base-node": "base"})

    def check(self):
        if self.job in ("mirror", "backup", "stream"):
            subprocess.run(["qemu-img", "compare", "-q", self.base, self.top], check=True)
        else:
            subprocess.run(["qemu-img", "compare", "-q", self.mid_copy, self.base], check=True)

    def cleanup(self):
        for p in (self.base, self.mid, self.top, getattr(self, "mid_copy", "")):
            if p and os.path.exists(p):
                os.unlink(p)


def run(binary, tag, setup, polled, iothread):
    args, (cmd, cmd_args) = setup.prepare()
    if iothread:
        args += ["--object", "iothread,id=io0" + os.environ.get("IOTHREAD_OPTS", "")]
    mon2 = common.path(f"{tag}-mon2.sock")
    if polled:
        if os.path.exists(mon2):
            os.unlink(mon2)
        args += ["--chardev", f"socket,id=mon1,path={mon2},server=on,wait=off",
                 "--monitor", "chardev=mon1"]
    d = common.Daemon(args, binary=binary, tag=tag)
    poller = None
    try:
        q = d.qmp()
        if polled:
            poller = Poller(mon2)
            poller.start()
        if iothread:
            node = "src" if setup.job in ("mirror", "backup") else "top"
            common.ok(q.cmd_raw("x-blockdev-set-iothread", {"node-name": node,
                                                             "iothread": "io0"}))
        t0 = time.time()
        common.ok(q.cmd_raw(cmd, cmd_args))
        if cmd == "blockdev-mirror":
            common.wait_event(q, "BLOCK_JOB_READY", timeout=300)
            common.ok(q.cmd_raw("job-complete", {"id": "j"}))
        common.wait_event(q, "BLOCK_JOB_COMPLETED", timeout=300)
        elapsed = time.time() - t0
        lat = []
        if poller:
            poller.finish()
            lat = poller.latencies
        q.close()
    finally:
        d.stop()
    setup.check()
    return elapsed, lat


def fio_iops(sock):
    out = common.fio("--name=l", "--ioengine=nbd", f"--uri=nbd+unix:///src?socket={sock}",
                     "--rw=randwrite", "--bs=4k", "--iodepth=16", "--time_based",
                     "--runtime=5", f"--size={SIZE}")
    return out["jobs"][0]["write"]["iops"]


def export_load(binary, tag, setup, with_job):
    """fio's IOPS through an NBD export of the source, with or without a mirror of it."""
    args, (cmd, cmd_args) = setup.prepare()
    sock = common.path(f"{tag}-exp.sock")
    args += ["--object", "iothread,id=io0", "--nbd-server",
             f"addr.type=unix,addr.path={sock}", "--export",
             "type=nbd,id=e,node-name=src,name=src,writable=on,iothread=io0"]
    d = common.Daemon(args, binary=binary, tag=tag)
    try:
        q = d.qmp()
        if with_job:
            common.ok(q.cmd_raw(cmd, cmd_args))
        iops = fio_iops(sock)
        if with_job:
            common.ok(q.cmd_raw("job-cancel", {"id": "j"}))
            common.wait_event(q, "BLOCK_JOB_CANCELLED", timeout=60)
        q.close()
    finally:
        d.stop()
    return iops


def export_load_table(a, daemons):
    print("\n## NBD export under a mirror: fio randwrite 4k QD16, 5 s\n")
    print("| medium | daemon | alone IOPS | during the mirror IOPS | kept |")
    print("|---|---|---|---|---:|")
    for medium in a.media.split(","):
        where = MEDIA[medium]
        os.makedirs(where, exist_ok=True)
        setup = Setup("mirror", where, medium == "disk")
        try:
            res = {t: ([], []) for _, t in daemons}
            for _ in range(REPS):
                for binary, tag in daemons:
                    res[tag][0].append(export_load(binary, tag, setup, False))
                    res[tag][1].append(export_load(binary, tag, setup, True))
            for _, tag in daemons:
                alone, busy = res[tag]
                kept = statistics.median(busy) / statistics.median(alone)
                print(f"| {medium} | {tag} | {', '.join(f'{x:.0f}' for x in alone)} | "
                      f"{', '.join(f'{x:.0f}' for x in busy)} | {kept:.2f} |", flush=True)
        finally:
            setup.cleanup()


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))] if v else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--polled", action="store_true")
    ap.add_argument("--iothread", action="store_true")
    ap.add_argument("--export-load", action="store_true")
    ap.add_argument("--poller-nice", type=int)
    ap.add_argument("--jobs", default="mirror,stream,commit,backup")
    ap.add_argument("--media", default="disk,tmpfs")
    ap.add_argument("stord", nargs="?", default="stord")
    a = ap.parse_args()
    global POLLER_NICE
    POLLER_NICE = a.poller_nice
    os.environ["STORD_TEST_DIR"] = tempfile.mkdtemp()
    common.WORKDIR = os.environ["STORD_TEST_DIR"]
    daemons = (("qemu-storage-daemon", "qsd"), (a.stord, "stord"))
    if a.export_load:
        export_load_table(a, daemons)
        return
    print("# Block job speed: 1 GiB of data, stord beside qsd\n")
    print(f"{REPS} runs per daemon, alternating; time from the command to "
          "BLOCK_JOB_COMPLETED (a mirror completed once ready); every result "
          "`qemu-img compare`-equal to its source.\n")
    modes = [False, True] if a.polled else [False]
    if a.iothread and a.jobs != "mirror":
        ap.error("--iothread: mirror only (qsd aborts on the others)")
    if a.iothread:
        print("The node each job copies from runs in an IoThread (x-blockdev-set-iothread).\n")
    if a.poller_nice is not None:
        print(f"The polling client's thread runs at nice {a.poller_nice}.\n")
    print("| job | medium | monitor | daemon | runs s | median s | MiB/s | x qsd | "
          "QMP p50 / p99 ms |")
    print("|---|---|---|---|---|---:|---:|---:|---|")
    for medium in a.media.split(","):
        where = MEDIA[medium]
        os.makedirs(where, exist_ok=True)
        for job in a.jobs.split(","):
            setup = Setup(job, where, medium == "disk")
            try:
                for polled in modes:
                    res = {t: [] for _, t in daemons}
                    lat = {t: [] for _, t in daemons}
                    for _ in range(REPS):
                        for binary, tag in daemons:
                            e, l = run(binary, tag, setup, polled, a.iothread)
                            res[tag].append(e)
                            lat[tag] += l
                    qsd = statistics.median(res["qsd"])
                    for _, tag in daemons:
                        m = statistics.median(res[tag])
                        runs = ", ".join(f"{t:.2f}" for t in res[tag])
                        q = (f"{pct(lat[tag], 0.5) * 1e3:.2f} / {pct(lat[tag], 0.99) * 1e3:.2f}"
                             if polled else "")
                        print(f"| {job} | {medium} | {'polled 5 ms' if polled else 'idle'} | "
                              f"{tag} | {runs} | {m:.2f} | {SIZE / m / (1 << 20):.0f} | "
                              f"{qsd / m:.2f} | {q} |", flush=True)
            finally:
                setup.cleanup()


if __name__ == "__main__":
    main()
