"""Add a file node and an NBD export at runtime, write and verify with fio, delete both."""

import os

import common
from common import ok, err


def test():
    img = common.sparse("runtime.img", 64 << 20)
    nbd = common.path("runtime-nbd.sock")
    d = common.Daemon(["--object", "iothread,id=io0"])
    try:
        q = d.qmp()
        ok(q.cmd_raw("blockdev-add", {"driver": "file", "node-name": "disk", "filename": img,
                                      "aio": "io_uring", "cache": {"direct": True}}))
        err(q.cmd_raw("blockdev-add", {"driver": "file", "node-name": "disk", "filename": img}),
            contains="Duplicate")
        err(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk"}),
            contains="NBD server not running")
        ok(q.cmd_raw("nbd-server-start", {"addr": {"type": "unix", "data": {"path": nbd}}}))
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e0", "node-name": "disk",
                                          "name": "disk", "writable": True, "iothread": "io0"}))
        exports = ok(q.cmd_raw("query-block-exports"))
        assert exports == [{"type": "nbd", "id": "e0", "node-name": "disk", "shutting-down": False}], exports
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        assert nodes[0]["node-name"] == "disk" and nodes[0]["cache"]["direct"] is True, nodes
        uri = f"nbd+unix:///disk?socket={nbd}"
        r = common.fio("--name=v", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite", "--bs=4k",
                       "--iodepth=8", "--size=16M", "--verify=crc32c", "--do_verify=1")
        assert r["jobs"][0]["error"] == 0, r["jobs"][0]
        # The node is in use by the export.
        err(q.cmd_raw("blockdev-del", {"node-name": "disk"}), contains="in use")
        ok(q.cmd_raw("block-export-del", {"id": "e0"}))
        ev = common.wait_event(q, "BLOCK_EXPORT_DELETED")
        assert ev["data"] == {"id": "e0"} and "seconds" in ev["timestamp"], ev
        assert ok(q.cmd_raw("query-block-exports")) == []
        ok(q.cmd_raw("blockdev-del", {"node-name": "disk"}))
        assert ok(q.cmd_raw("query-named-block-nodes")) == []
        ok(q.cmd_raw("nbd-server-stop"))
        err(q.cmd_raw("nbd-server-stop"), contains="not running")
        # A FUSE export added and deleted at runtime: the file appears, then is unmounted.
        img2 = common.sparse("fuse.img", 8 << 20)
        mnt = common.path("fuse-mnt")
        open(mnt, "w").close()
        ok(q.cmd_raw("blockdev-add", {"driver": "file", "node-name": "f", "filename": img2}))
        ok(q.cmd_raw("block-export-add", {"type": "fuse", "id": "fx", "node-name": "f",
                                          "mountpoint": mnt, "writable": True,
                                          "iothread": ["io0"]}))
        assert os.path.getsize(mnt) == 8 << 20
        with open(mnt, "r+b") as fh:
            fh.write(b"stord" * 100)
        assert any(e["id"] == "fx" and e["type"] == "fuse" for e in ok(q.cmd_raw("query-block-exports")))
        ok(q.cmd_raw("block-export-del", {"id": "fx"}))
        common.wait_event(q, "BLOCK_EXPORT_DELETED")
        assert os.path.getsize(mnt) == 0, "still mounted"
        with open(img2, "rb") as fh:
            assert fh.read(500) == b"stord" * 100
        ok(q.cmd_raw("blockdev-del", {"node-name": "f"}))

        # iothreads can come and go at runtime too.
        ok(q.cmd_raw("object-add", {"qom-type": "iothread", "id": "io1", "poll-max-ns": 1000}))
        ids = [t["id"] for t in ok(q.cmd_raw("query-iothreads"))]
        assert ids == ["io0", "io1"], ids
        ok(q.cmd_raw("object-del", {"id": "io1"}))
        names = [c["name"] for c in ok(q.cmd_raw("query-commands"))]
        for c in ["query-iothreads", "qom-set", "block-export-add", "quit"]:
            assert c in names, names
        q.close()
    finally:
        d.stop()


common.main(test)
