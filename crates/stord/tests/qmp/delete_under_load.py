"""Delete an export (mode hard) while fio hammers it: clients are disconnected, the
daemon survives, the event comes, and the node can be deleted once they are gone."""

import subprocess
import time

import common
from common import ok, err


def test():
    img = common.sparse("load.img", 64 << 20)
    nbd = common.path("load-nbd.sock")
    d = common.Daemon(["--object", "iothread,id=io0",
                       "--blockdev", f"driver=file,node-name=disk,filename={img},aio=io_uring,cache.direct=on",
                       "--nbd-server", f"addr.type=unix,addr.path={nbd}",
                       "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on,iothread=io0"])
    try:
        q = d.qmp()
        uri = f"nbd+unix:///disk?socket={nbd}"
        fio = subprocess.Popen(["fio", "--name=l", "--ioengine=nbd", f"--uri={uri}", "--rw=randrw",
                                "--bs=4k", "--iodepth=16", "--numjobs=2", "--time_based",
                                "--runtime=20", "--size=64M"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        # In use: safe mode refuses, hard mode disconnects.
        err(q.cmd_raw("block-export-del", {"id": "e0"}), contains="in use")
        ok(q.cmd_raw("block-export-del", {"id": "e0", "mode": "hard"}))
        ev = common.wait_event(q, "BLOCK_EXPORT_DELETED")
        assert ev["data"]["id"] == "e0"
        fio.wait(timeout=20)
        assert fio.returncode != 0, "fio should see its connection dropped"
        assert ok(q.cmd_raw("query-block-exports")) == []
        ok(q.cmd_raw("blockdev-del", {"node-name": "disk"}))
        assert d.proc.poll() is None
        assert "qemu" in ok(q.cmd_raw("query-version"))
        q.close()
    finally:
        d.stop()


common.main(test)
