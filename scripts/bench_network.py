#!/usr/bin/env python3
"""stord and qemu-storage-daemon side by side on network back ends: the same RBD image (a
one-OSD cluster from scripts/ceph-cluster.sh) and the same NBD server (qemu-nbd serving a
file in /dev/shm), each daemon exporting the node over NBD on an IoThread, driven by fio's
nbd engine (libnbd). Cases: 4k randread and randwrite at QD1 and QD16, 64k sequential read.
Each case runs RUNTIME seconds, REPS times, the daemons alternating; the report gives
means with 95 % intervals (Student's t), stord/qsd ratios, and the daemon's CPU (user +
system, all its threads, librbd's included) per I/O.

Usage (as root, from the repository, stord built with --release):
    scripts/bench_network.py [--runtime 5] [--reps 3] [--out docs/benchmarks-network.md]
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORD = os.path.join(ROOT, "target/release/stord")
CLUSTER = os.path.join(ROOT, "scripts/ceph-cluster.sh")
SIZE = 1 << 30
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}

CASES = [
    ("4k randread QD1", ["--rw=randread", "--bs=4k", "--iodepth=1"]),
    ("4k randread QD16", ["--rw=randread", "--bs=4k", "--iodepth=16"]),
    ("4k randwrite QD1", ["--rw=randwrite", "--bs=4k", "--iodepth=1"]),
    ("4k randwrite QD16", ["--rw=randwrite", "--bs=4k", "--iodepth=16"]),
    ("64k read QD4", ["--rw=read", "--bs=64k", "--iodepth=4"]),
]


def cpu_ns(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // tick


class Daemon:
    def __init__(self, binary, blockdev, sock, tmp):
        if os.path.exists(sock):
            os.unlink(sock)
        self.proc = subprocess.Popen(
            [binary, "--object", "iothread,id=io0", "--blockdev", blockdev,
             "--nbd-server", f"addr.type=unix,addr.path={sock}",
             "--export", "type=nbd,id=e0,node-name=n0,name=e0,writable=on,iothread=io0"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "daemon.log"), "a"))
        deadline = time.time() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{binary} did not start (see {tmp}/daemon.log)")
            time.sleep(0.05)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fio(sock, args, runtime):
    out = subprocess.run(
        ["fio", "--name=b", "--ioengine=nbd", f"--uri=nbd+unix:///e0?socket={sock}",
         "--size=1G", "--time_based", f"--runtime={runtime}", "--ramp_time=1",
         "--randrepeat=0", "--norandommap", "--output-format=json",
         "--verify_state_save=0"] + args,
        capture_output=True, text=True, check=True)
    j = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = j["read"] if j["read"]["total_ios"] else j["write"]
    pct = side["clat_ns"].get("percentile", {})
    return {
        "iops": side["iops"],
        "ios": side["total_ios"],
        "p50_us": pct.get("50.000000", 0) / 1000,
        "p99_us": pct.get("99.000000", 0) / 1000,
    }


def one(daemon, sock, case_args, runtime):
    """One fio run against a running daemon: its figures and the daemon's CPU per I/O."""
    c0 = cpu_ns(daemon.proc.pid)
    r = fio(sock, case_args, runtime)
    c1 = cpu_ns(daemon.proc.pid)
    # fio's ramp second is not counted in its I/Os but is in the CPU: scale by time.
    r["cpu_us_per_io"] = (c1 - c0) / 1000 / max(1, r["iops"] * (runtime + 1))
    return r


def mean_ci(xs):
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, T95.get(len(xs), 2.0) * statistics.stdev(xs) / len(xs) ** 0.5


def fmt(xs, digits=0):
    m, ci = mean_ci(xs)
    return f"{m:,.{digits}f} ± {ci:,.{digits}f}"


def verdict(a, b):
    (ma, ca), (mb, cb) = mean_ci(a), mean_ci(b)
    if ma - ca > mb + cb:
        return "stord ahead"
    if mb - cb > ma + ca:
        return "qsd ahead"
    return "within noise"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks-network.md"))
    o = ap.parse_args()
    if not os.path.exists(STORD):
        raise SystemExit("build first: cargo build --release -p stord")
    tmp = tempfile.mkdtemp(prefix="stord-bench-net-")
    ceph = os.path.join(tmp, "ceph")
    r = subprocess.run([CLUSTER, "start", ceph], capture_output=True, text=True,
                       env=dict(os.environ, CEPH_OBJECTSTORE="bluestore",
                                CEPH_STORE_BYTES=str(4 << 30)))
    if r.returncode:
        raise SystemExit(r.stderr)
    conf = r.stdout.strip().splitlines()[-1]
    subprocess.run(["rbd", "-c", conf, "create", "rbd/bench", "--size", "1G"], check=True)
    # Fill the image so reads hit data, not unallocated objects.
    subprocess.run(["rbd", "-c", conf, "bench", "--io-type", "write", "--io-size", "4M",
                    "--io-total", "1G", "--io-pattern", "seq", "bench"],
                   check=True, capture_output=True)
    shm = tempfile.mkdtemp(prefix="stord-bench-nbd-", dir="/dev/shm")
    img = os.path.join(shm, "disk.raw")
    with open(img, "wb") as f:
        for _ in range(SIZE >> 20):
            f.write(os.urandom(1 << 20))
    nbd_sock = os.path.join(tmp, "server.sock")
    server = subprocess.Popen(["qemu-nbd", "-f", "raw", "-x", "exp", "-k", nbd_sock,
                               "-e", "4", "-t", "--cache=none", "--aio=threads", img],
                              stderr=subprocess.DEVNULL)
    while not os.path.exists(nbd_sock):
        time.sleep(0.05)
    media = [
        ("rbd (1 OSD, bluestore on a file)",
         f"driver=rbd,node-name=n0,pool=rbd,image=bench,conf={conf}"),
        ("nbd (qemu-nbd, file in /dev/shm)",
         f"driver=nbd,node-name=n0,server.type=unix,server.path={nbd_sock},export=exp"),
    ]
    peers = [("stord", STORD), ("qsd", shutil.which("qemu-storage-daemon"))]
    results = {}
    try:
        for medium, blockdev in media:
            # Both daemons run side by side for the whole medium (started once, warmed
            # once); the runs alternate between them.
            running = {}
            for name, binary in peers:
                sock = os.path.join(tmp, f"{name}.sock")
                running[name] = (Daemon(binary, blockdev, sock, tmp), sock)
                fio(sock, ["--rw=read", "--bs=1M", "--iodepth=4", "--size=256M"], 2)
            try:
                for case, args in CASES:
                    for rep in range(o.reps):
                        order = peers if rep % 2 == 0 else peers[::-1]
                        for name, _ in order:
                            d, sock = running[name]
                            res = one(d, sock, args, o.runtime)
                            results.setdefault((medium, case, name), []).append(res)
                            print(f"{medium} | {case} | {name} rep {rep}: "
                                  f"{res['iops']:.0f} IOPS, p50 {res['p50_us']:.0f} µs, "
                                  f"{res['cpu_us_per_io']:.1f} µs CPU/IO", flush=True)
            finally:
                for d, _ in running.values():
                    d.stop()
    finally:
        server.kill()
        subprocess.run([CLUSTER, "stop", ceph], capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)

    qsd_ver = subprocess.run(["qemu-storage-daemon", "--version"], capture_output=True,
                             text=True).stdout.splitlines()[0]
    lines = [
        "# Network back ends: stord beside qemu-storage-daemon",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `scripts/bench_network.py --runtime "
        f"{o.runtime} --reps {o.reps}` on this project's VM (2 cores; noisy), {qsd_ver}.",
        "Each daemon serves the node over NBD on one IoThread; both run for the whole "
        "medium and fio's nbd engine (libnbd) drives one at a time, alternating. The rbd node is a 1 GiB image on a one-OSD cluster "
        "on 127.0.0.1 (bluestore on a file, `scripts/ceph-cluster.sh`); the nbd node "
        "connects to qemu-nbd serving a file in /dev/shm. Means ± 95 % intervals over "
        f"{o.reps} runs of {o.runtime} s, the daemons alternating; CPU is the daemon "
        "process's user + system time (all threads, librbd's too) per I/O.",
        "",
        "| back end | case | stord IOPS | qsd IOPS | ratio | verdict | stord p50/p99 µs "
        "| qsd p50/p99 µs | stord CPU µs/IO | qsd CPU µs/IO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for medium, _ in media:
        for case, _ in CASES:
            s = results[(medium, case, "stord")]
            q = results[(medium, case, "qsd")]
            si, qi = [x["iops"] for x in s], [x["iops"] for x in q]
            ratio = statistics.mean(si) / statistics.mean(qi)
            pair = lambda rs: (f"{statistics.mean(x['p50_us'] for x in rs):.0f}/"
                               f"{statistics.mean(x['p99_us'] for x in rs):.0f}")
            lines.append(
                f"| {medium} | {case} | {fmt(si)} | {fmt(qi)} | {ratio:.2f}x | "
                f"{verdict(si, qi)} | {pair(s)} | {pair(q)} | "
                f"{fmt([x['cpu_us_per_io'] for x in s], 1)} | "
                f"{fmt([x['cpu_us_per_io'] for x in q], 1)} |")
    lines.append("")
    with open(o.out, "w") as f:
        f.write("\n".join(lines))
    raw = os.path.join(ROOT, "results", "network", "results.json")
    os.makedirs(os.path.dirname(raw), exist_ok=True)
    with open(raw, "w") as f:
        json.dump({" | ".join(k): v for k, v in results.items()}, f, indent=1)
    print("\n".join(lines))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
