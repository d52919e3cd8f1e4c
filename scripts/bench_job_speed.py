#!/usr/bin/env python3
"""Whether a block job holds its speed limit, stord beside qsd.

A 24 MiB run of data in a base image is streamed into an empty overlay with
`block-stream speed=8 MiB/s`; the time from the command to BLOCK_JOB_COMPLETED gives the
rate each daemon held. Runs alternate between the daemons, REPS times (3 by default).

    python3 scripts/bench_job_speed.py [STORD_BINARY] > results/jobs/speed-DATE.md
"""

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "crates/stord/tests/qmp"))
WORK = tempfile.mkdtemp()
os.environ["STORD_TEST_DIR"] = WORK
import common  # noqa: E402

DATA = 24 << 20
SPEED = 8 << 20
REPS = int(os.environ.get("REPS", "3"))


def run(binary, tag):
    base, top = common.path(f"{tag}-base.qcow2"), common.path(f"{tag}-top.qcow2")
    for p in (base, top):
        if os.path.exists(p):
            os.unlink(p)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", base, "64M"], check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P 0x5a 0 {DATA}", base],
                   check=True, capture_output=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top],
                   check=True)
    d = common.Daemon(["--blockdev", "driver=qcow2,node-name=top,file.driver=file,"
                       f"file.filename={top}"], binary=binary, tag=tag)
    try:
        q = d.qmp()
        t0 = time.time()
        common.ok(q.cmd_raw("block-stream", {"device": "top", "job-id": "j", "speed": SPEED}))
        common.wait_event(q, "BLOCK_JOB_COMPLETED", timeout=60)
        elapsed = time.time() - t0
        q.close()
    finally:
        d.stop()
    return elapsed


def main():
    stord = sys.argv[1] if len(sys.argv) > 1 else "stord"
    res = {"qsd": [], "stord": []}
    for _ in range(REPS):
        for binary, tag in (("qemu-storage-daemon", "qsd"), (stord, "stord")):
            res[tag].append(run(binary, tag))
    print(f"# Block job speed limit: block-stream of {DATA >> 20} MiB at {SPEED >> 20} MiB/s\n")
    print(f"{REPS} runs per daemon, alternating; rate = data / (command to "
          "BLOCK_JOB_COMPLETED).\n")
    print("| daemon | elapsed s | MiB/s | off the limit |")
    print("|---|---|---|---|")
    for tag, v in res.items():
        rates = [DATA / x / (1 << 20) for x in v]
        worst = max(abs(r - (SPEED >> 20)) / (SPEED >> 20) for r in rates)
        print(f"| {tag} | {', '.join(f'{x:.2f}' for x in v)} | "
              f"{', '.join(f'{r:.2f}' for r in rates)} | {worst * 100:.1f} % at most |")


if __name__ == "__main__":
    main()
