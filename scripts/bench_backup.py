#!/usr/bin/env python3
"""Backup speed, stord beside qsd: blockdev-backup sync=full of a 1 GiB qcow2 image whose
every cluster holds data into an empty qcow2 (cache.direct=on on both where the medium
takes O_DIRECT), on this machine's disk and on /dev/shm; the time from the command to
BLOCK_JOB_COMPLETED. Runs alternate between the daemons, REPS times (3 by default).

    python3 scripts/bench_backup.py [STORD_BINARY] > results/jobs/backup-DATE.md
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "crates/stord/tests/qmp"))
import common  # noqa: E402

SIZE = 1 << 30
REPS = int(os.environ.get("REPS", "3"))
MEDIA = {
    "disk": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "bench-backup"),
    "tmpfs": "/dev/shm/stord-bench-backup",
}


def qcow2(path):
    if os.path.exists(path):
        os.unlink(path)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", path, str(SIZE)], check=True)


def run(binary, tag, where, direct):
    src, tgt = os.path.join(where, "src.qcow2"), os.path.join(where, f"{tag}-tgt.qcow2")
    qcow2(tgt)
    cache = "on" if direct else "off"
    d = common.Daemon([
        "--blockdev", f"driver=qcow2,node-name=src,file.driver=file,file.filename={src},"
                      f"file.cache.direct={cache},file.aio=io_uring",
        "--blockdev", f"driver=qcow2,node-name=tgt,file.driver=file,file.filename={tgt},"
                      f"file.cache.direct={cache},file.aio=io_uring",
    ], binary=binary, tag=tag)
    try:
        q = d.qmp()
        t0 = time.time()
        common.ok(q.cmd_raw("blockdev-backup", {"job-id": "b", "device": "src",
                                                "target": "tgt", "sync": "full"}))
        common.wait_event(q, "BLOCK_JOB_COMPLETED", timeout=300)
        elapsed = time.time() - t0
        q.close()
    finally:
        d.stop()
    subprocess.run(["qemu-img", "compare", "-q", src, tgt], check=True)
    os.unlink(tgt)
    return elapsed


def main():
    stord = sys.argv[1] if len(sys.argv) > 1 else "stord"
    print("# Backup speed: blockdev-backup sync=full of 1 GiB, stord beside qsd\n")
    print(f"{REPS} runs per daemon and medium, alternating; time from the command to "
          "BLOCK_JOB_COMPLETED; every target `qemu-img compare`-equal to its source.\n")
    print("| medium | daemon | runs s | median s | MiB/s | × qsd |")
    print("|---|---|---|---:|---:|---:|")
    for medium, where in MEDIA.items():
        os.makedirs(where, exist_ok=True)
        os.environ["STORD_TEST_DIR"] = tempfile.mkdtemp()
        src = os.path.join(where, "src.qcow2")
        qcow2(src)
        subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x5a 0 {SIZE}", src],
                       check=True, capture_output=True)
        direct = medium == "disk"
        res = {"qsd": [], "stord": []}
        for _ in range(REPS):
            for binary, tag in (("qemu-storage-daemon", "qsd"), (stord, "stord")):
                res[tag].append(run(binary, tag, where, direct))
        qsd = statistics.median(res["qsd"])
        for tag in ("qsd", "stord"):
            m = statistics.median(res[tag])
            runs = ", ".join(f"{t:.2f}" for t in res[tag])
            print(f"| {medium} | {tag} | {runs} | {m:.2f} | {SIZE / m / (1 << 20):.0f} | "
                  f"{qsd / m:.2f} |")
        os.unlink(src)


if __name__ == "__main__":
    main()
