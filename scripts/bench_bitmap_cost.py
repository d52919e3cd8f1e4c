#!/usr/bin/env python3
"""The cost of an active dirty bitmap on the write path, stord beside qsd.

Each daemon serves a 1 GiB null-co node over NBD on one IoThread; fio's nbd engine writes
4 KiB at random, QD16, for 5 s, without a bitmap and with one recording bitmap (added over
QMP with QEMU's default granularity). Runs alternate between the daemons, REPS times (3 by
default); the report gives mean IOPS with a 95 % interval and each daemon's drop.

    python3 scripts/bench_bitmap_cost.py [STORD_BINARY] > results/bitmaps/cost-DATE.md
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from qemu.qmp.legacy import QEMUMonitorProtocol

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}


def one(binary, bitmap):
    with tempfile.TemporaryDirectory() as d:
        sock, qmp, pid = f"{d}/nbd.sock", f"{d}/qmp.sock", f"{d}/pid"
        p = subprocess.Popen([
            binary, "--object", "iothread,id=io0",
            "--blockdev", "driver=null-co,node-name=n,size=1073741824",
            "--nbd-server", f"addr.type=unix,addr.path={sock}",
            "--export", "type=nbd,id=e,node-name=n,name=n,writable=on,iothread=io0",
            "--chardev", f"socket,id=m,path={qmp},server=on,wait=off",
            "--monitor", "chardev=m", "--pidfile", pid,
        ], stderr=subprocess.DEVNULL)
        for _ in range(200):
            if os.path.exists(pid):
                break
            time.sleep(0.05)
        q = QEMUMonitorProtocol(qmp)
        q.connect(negotiate=True)
        if bitmap:
            assert "return" in q.cmd_raw("block-dirty-bitmap-add", {"node": "n", "name": "b"})
        out = subprocess.run([
            "fio", "--ioengine=nbd", f"--uri=nbd+unix:///n?socket={sock}", "--rw=randwrite",
            "--bs=4k", "--iodepth=16", "--runtime=5", "--time_based", "--name=x",
            "--output-format=json", "--verify_state_save=0",
        ], capture_output=True, text=True, check=True).stdout
        count = None
        if bitmap:
            nodes = q.cmd_raw("query-named-block-nodes")["return"]
            count = nodes[0]["dirty-bitmaps"][0]["count"]
            assert count > 0, "the bitmap recorded nothing"
        q.close()
        p.terminate()
        p.wait()
        iops = json.loads(out[out.index("{"):])["jobs"][0]["write"]["iops"]
        return iops, count


def summary(xs):
    m = statistics.mean(xs)
    h = T95[len(xs)] * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0
    return m, h


def main():
    stord = sys.argv[1] if len(sys.argv) > 1 else "target/release/stord"
    reps = int(os.environ.get("REPS", "3"))
    daemons = [("qsd", "qemu-storage-daemon"), ("stord", stord)]
    res = {(n, b): [] for n, _ in daemons for b in (False, True)}
    for _ in range(reps):
        for name, binary in daemons:
            for bitmap in (False, True):
                res[(name, bitmap)].append(one(binary, bitmap)[0])
    print("# Cost of a recording dirty bitmap on NBD writes (null-co 1 GiB, 4k randwrite QD16,"
          f" 5 s x {reps}, alternating)\n")
    print("| daemon | no bitmap IOPS | with bitmap IOPS | drop |")
    print("|---|---|---|---|")
    for name, _ in daemons:
        (a, ha), (b, hb) = summary(res[(name, False)]), summary(res[(name, True)])
        print(f"| {name} | {a:,.0f} ± {ha:,.0f} | {b:,.0f} ± {hb:,.0f} | "
              f"{100 * (a - b) / a:.1f} % |")
    print("\nRaw IOPS per run:", json.dumps({f"{n}/{'bitmap' if b else 'plain'}": v
                                            for (n, b), v in res.items()}))


main()
