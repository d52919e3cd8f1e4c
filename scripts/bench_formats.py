#!/usr/bin/env python3
"""stord against qemu-storage-daemon on the image formats whose cost is the daemon's own:
LUKS (the `luks` driver, and qcow2 with `encrypt.format=luks`) and qcow2 with extended L2
entries (first 4k writes into empty 128 KiB subclustered clusters over a backing file, as
Proxmox's overlays take them: fio's `rw=write:124k` puts one 4k write at the start of each
cluster in turn, over a 128 GiB overlay that a run never wraps, so every write allocates a
cluster and copies nothing). fio's nbd engine against each daemon's NBD export of the
same image, one IoThread each; images on /dev/shm (so the cipher and the metadata, not a
disk, set the pace), the file node on io_uring for both daemons.

Each case runs REPS times per daemon, alternating stord qsd qsd stord ..., SECONDS each;
a writing case gets a fresh image before every run. Prints and writes a Markdown table of
IOPS and the daemon's CPU per I/O (utime + stime from /proc), mean [min-max].

usage: scripts/bench_formats.py [--stord BIN] [--reps 3] [--seconds 5] [--out FILE.md]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

TICK = os.sysconf("SC_CLK_TCK")
SECRET = "secret,id=sec0,data=bench-pass"
DIR = "/dev/shm/stord-bench-formats"
SIZE = "1G"
# 1 Mi clusters of 128 KiB: more first writes than a run of a few seconds makes.
OVERLAY_SIZE = "128G"


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def qemu_img(*args):
    subprocess.run(["qemu-img", *args], check=True, stdout=subprocess.DEVNULL)


def make_image(kind):
    """A fresh image of `kind` under DIR; returns the --blockdev of its top node."""
    shutil.rmtree(DIR, ignore_errors=True)
    os.makedirs(DIR)
    img = f"{DIR}/{kind}.img"
    file = f"file.driver=file,file.filename={img},file.aio=io_uring"
    obj = ["--object", SECRET]
    if kind == "luks":
        qemu_img("create", *obj, "-f", "luks", "-o", "key-secret=sec0,iter-time=10", img, SIZE)
        fill(f"driver=luks,node-name=n,key-secret=sec0,{file}")
        return f"driver=luks,node-name=n,key-secret=sec0,{file}"
    if kind == "qcow2-luks":
        qemu_img("create", *obj, "-f", "qcow2", "-o",
                 "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10", img, SIZE)
        node = f"driver=qcow2,node-name=n,encrypt.format=luks,encrypt.key-secret=sec0,{file}"
        fill(node)
        return node
    if kind == "subclusters":
        base = f"{DIR}/base.qcow2"
        qemu_img("create", "-f", "qcow2", base, SIZE)
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x5a 0 {SIZE}", base],
                       check=True, stdout=subprocess.DEVNULL)
        qemu_img("create", "-f", "qcow2", "-o", "extended_l2=on,cluster_size=128k",
                 "-b", base, "-F", "qcow2", img, OVERLAY_SIZE)
        return f"driver=qcow2,node-name=n,{file}"
    raise ValueError(kind)


def fill(node):
    """Writes the whole image once (reads then read data, as a used volume's do)."""
    subprocess.run(["qemu-io", "--object", SECRET, "--image-opts", node.replace(
        "node-name=n,", "").replace(",file.aio=io_uring", ""), "-c", f"write -P 0x5a 0 {SIZE}"],
        check=True, stdout=subprocess.DEVNULL)


def start(who, binary, node, sock):
    """The daemon serving `node` over NBD at `sock`, once it listens; its error if it
    exits first."""
    args = [binary, "--object", SECRET, "--object", "iothread,id=io0", "--blockdev", node,
            "--nbd-server", f"addr.type=unix,addr.path={sock}",
            "--export", "type=nbd,id=e,node-name=n,name=n,writable=on,iothread=io0"]
    p = subprocess.Popen(args, stderr=subprocess.PIPE)
    for _ in range(400):
        if os.path.exists(sock):
            return p
        if p.poll() is not None:
            raise RuntimeError(f"{who} exited: {p.stderr.read().decode()}")
        time.sleep(0.05)
    p.kill()
    raise RuntimeError(f"{who} did not start")


def run_once(who, binary, kind, workload, seconds):
    node = make_image(kind)
    rw, bs, qd = workload
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "nbd.sock")
    daemon = start(who, binary, node, sock)
    try:
        cpu0 = cpu_seconds(daemon.pid)
        out = subprocess.run(
            ["fio", "--ioengine=nbd", f"--uri=nbd+unix:///n?socket={sock}", f"--rw={rw}",
             f"--bs={bs}", f"--iodepth={qd}", "--runtime", str(seconds), "--time_based",
             "--name=f", "--output-format=json", "--verify_state_save=0"],
            capture_output=True, text=True, check=True).stdout
        cpu = cpu_seconds(daemon.pid) - cpu0
        job = json.loads(out[out.index("{"):])["jobs"][0]
        side = job["write"] if "write" in rw else job["read"]
        return side["iops"], cpu * 1e6 / max(side["total_ios"], 1)
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(d, ignore_errors=True)


CASES = [
    ("luks", ("randread", "4k", 1)), ("luks", ("randread", "4k", 16)),
    ("luks", ("randwrite", "4k", 1)), ("luks", ("randwrite", "4k", 16)),
    ("luks", ("read", "1M", 1)), ("luks", ("write", "1M", 1)),
    ("qcow2-luks", ("randread", "4k", 1)), ("qcow2-luks", ("randread", "4k", 16)),
    ("qcow2-luks", ("randwrite", "4k", 1)), ("qcow2-luks", ("randwrite", "4k", 16)),
    ("qcow2-luks", ("read", "1M", 1)), ("qcow2-luks", ("write", "1M", 1)),
    ("subclusters", ("write:124k", "4k", 1)), ("subclusters", ("write:124k", "4k", 16)),
]


def row(kind, workload, res):
    rw, bs, qd = workload
    s = {w: [r[0] for r in res[w]] for w in res}
    c = {w: [r[1] for r in res[w]] for w in res}
    fmt = lambda xs, f: f"{statistics.mean(xs):{f}} [{min(xs):{f}}-{max(xs):{f}}]"
    ratio = statistics.mean(s["stord"]) / statistics.mean(s["qsd"])
    overlap = min(s["stord"]) <= max(s["qsd"]) and min(s["qsd"]) <= max(s["stord"])
    verdict = "within noise" if overlap else ("stord ahead" if ratio > 1 else "qsd ahead")
    return (f"| {kind} | {rw} {bs} QD{qd} | {fmt(s['stord'], '.0f')} | {fmt(s['qsd'], '.0f')} "
            f"| {ratio:.2f} | {fmt(c['stord'], '.1f')} | {fmt(c['qsd'], '.1f')} | {verdict} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stord", default="target/release/stord")
    ap.add_argument("--qsd", default="qemu-storage-daemon")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--only", help="run only the cases of this image kind")
    ap.add_argument("--out")
    o = ap.parse_args()
    bins = {"stord": o.stord, "qsd": o.qsd}
    lines = [f"stord `{o.stord}` against `{o.qsd}`; {o.reps} runs of {o.seconds} s each per "
             "daemon, alternating; mean [min-max]; CPU is the daemon's user + system time "
             "per I/O.", "",
             "| image | workload | stord IOPS | qsd IOPS | stord/qsd | stord CPU µs/IO | "
             "qsd CPU µs/IO | verdict |", "|---|---|---|---|---|---|---|---|"]
    try:
        for kind, workload in CASES:
            if o.only and kind != o.only:
                continue
            res = {"stord": [], "qsd": []}
            order = ["stord", "qsd", "qsd", "stord"] * ((o.reps + 1) // 2)
            for who in order:
                if len(res[who]) == o.reps:
                    continue
                r = run_once(who, bins[who], kind, workload, o.seconds)
                res[who].append(r)
                print(f"{kind} {workload}: {who} {r[0]:.0f} IOPS, {r[1]:.1f} µs CPU/IO",
                      flush=True)
            lines.append(row(kind, workload, res))
    finally:
        shutil.rmtree(DIR, ignore_errors=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if o.out:
        with open(o.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
