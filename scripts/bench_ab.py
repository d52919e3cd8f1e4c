#!/usr/bin/env python3
"""Two stord builds side by side on the cases a refactor must not slow: fio's nbd engine,
4k random reads, against a null-co node at QD16 and against the fast device (a loop device
with direct I/O over a file in /dev/shm, file driver on io_uring, O_DIRECT) at QD1. Each
case runs REPS times per build, alternating A B B A ... (on /dev/shm the first run pays for
fresh pages), each run SECONDS long; prints and writes a Markdown table of IOPS and the
daemon's CPU per I/O with min-max intervals, and says "within noise" where they overlap.

usage: scripts/bench_ab.py A_BINARY B_BINARY [--reps 3] [--seconds 5] [--out FILE.md]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

FASTDEV_FILE = "/dev/shm/stord-ab-fastdev.img"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run_once(binary, node, iodepth, seconds):
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "nbd.sock")
    args = [binary, "--object", "iothread,id=io0", "--blockdev", node,
            "--nbd-server", f"addr.type=unix,addr.path={sock}",
            "--export", "type=nbd,id=e,node-name=n,name=n,iothread=io0"]
    daemon = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        cpu0 = cpu_seconds(daemon.pid)
        out = subprocess.run(
            ["fio", "--ioengine=nbd", f"--uri=nbd+unix:///n?socket={sock}", "--rw=randread",
             "--bs=4k", f"--iodepth={iodepth}", "--runtime", str(seconds), "--time_based",
             "--name=ab", "--output-format=json", "--verify_state_save=0"],
            capture_output=True, text=True, check=True).stdout
        cpu = cpu_seconds(daemon.pid) - cpu0
        job = json.loads(out[out.index("{"):])["jobs"][0]["read"]
        ios = job["total_ios"]
        return job["iops"], cpu * 1e6 / max(ios, 1)
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(d, ignore_errors=True)


def attach_fastdev():
    subprocess.run(["truncate", "-s", "1G", FASTDEV_FILE], check=True)
    subprocess.run(["dd", "if=/dev/urandom", f"of={FASTDEV_FILE}", "bs=1M", "count=1024",
                    "conv=notrunc", "status=none"], check=True)
    return subprocess.run(["losetup", "--direct-io=on", "--find", "--show", FASTDEV_FILE],
                          capture_output=True, text=True, check=True).stdout.strip()


def summary(xs):
    return statistics.mean(xs), min(xs), max(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--out")
    o = ap.parse_args()
    dev = attach_fastdev()
    cases = [
        ("NBD, null-co, 4k randread QD16", "driver=null-co,node-name=n,size=1G", 16),
        ("NBD, fast device (file, io_uring, O_DIRECT), 4k randread QD1",
         f"driver=host_device,node-name=n,filename={dev},aio=io_uring,cache.direct=on", 1),
    ]
    rows = []
    try:
        for name, node, qd in cases:
            res = {"A": [], "B": []}
            order = ["A", "B", "B", "A"] * ((o.reps + 1) // 2)
            counts = {"A": 0, "B": 0}
            for who in order:
                if counts[who] == o.reps:
                    continue
                counts[who] += 1
                r = run_once(o.a if who == "A" else o.b, node, qd, o.seconds)
                res[who].append(r)
                print(f"{name}: {who} {r[0]:.0f} IOPS, {r[1]:.2f} µs CPU/IO", flush=True)
            rows.append((name, res))
    finally:
        subprocess.run(["losetup", "-d", dev])
        os.unlink(FASTDEV_FILE)
    lines = [f"A = `{o.a}`, B = `{o.b}`; {o.reps} runs of {o.seconds} s each, alternating "
             "A B B A; mean [min-max].", "",
             "| case | A IOPS | B IOPS | B/A | A CPU µs/IO | B CPU µs/IO | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, res in rows:
        ia, ib = (summary([r[0] for r in res[w]]) for w in "AB")
        ca, cb = (summary([r[1] for r in res[w]]) for w in "AB")
        overlap = ia[1] <= ib[2] and ib[1] <= ia[2]
        verdict = "within noise" if overlap else ("B faster" if ib[0] > ia[0] else "B slower")
        lines.append(
            f"| {name} | {ia[0]:.0f} [{ia[1]:.0f}-{ia[2]:.0f}] | {ib[0]:.0f} [{ib[1]:.0f}-"
            f"{ib[2]:.0f}] | {ib[0] / ia[0]:.3f} | {ca[0]:.2f} [{ca[1]:.2f}-{ca[2]:.2f}] | "
            f"{cb[0]:.2f} [{cb[1]:.2f}-{cb[2]:.2f}] | {verdict} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if o.out:
        with open(o.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
