"""The OpenMetrics listener (`--object metrics`, stord's own): after a known fio workload
through an NBD export, a scrape over TCP parses with prometheus_client's OpenMetrics
parser (a client nobody here wrote) and its numbers are query-blockstats' (and fio's);
one added at run time on a unix socket answers too and goes with object-del (its socket
removed); a client that sends nothing does not hold up the others, a POST gets 405,
qom-list shows the objects."""

import http.client
import os
import socket
import time

import common
from common import ok
from prometheus_client.openmetrics.parser import text_string_to_metric_families

SIZE = 64 << 20


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(self.unix_path)


def scrape(conn):
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    assert r.status == 200, r.status
    assert r.getheader("Content-Type").startswith("application/openmetrics-text"), \
        r.getheader("Content-Type")
    text = r.read().decode()
    conn.close()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, s.labels.get("node"), s.labels.get("op"))
            samples[key] = s.value
    return samples


def test():
    img = common.path("me.qcow2")
    common.qcow2(img, SIZE)
    sock = common.path("me.sock")
    port = free_port()
    d = common.Daemon([
        "--blockdev", f"driver=file,node-name=f,filename={img}",
        "--blockdev", "driver=qcow2,node-name=disk,file=f",
        "--nbd-server", f"addr.type=unix,addr.path={sock}",
        "--export", "type=nbd,id=live,node-name=disk,name=live,writable=on",
        "--object", f"metrics,id=m0,addr.type=inet,addr.host=127.0.0.1,addr.port={port}",
    ])
    try:
        q = d.qmp()
        uri = f"nbd+unix:///live?socket={sock}"
        common.fio("--name=w", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
                   "--bs=4k", "--size=8M", "--io_size=4M", "--iodepth=4", "--fsync=32")
        common.fio("--name=r", "--ioengine=nbd", f"--uri={uri}", "--rw=randread",
                   "--bs=4k", "--size=8M", "--io_size=8M", "--iodepth=4")
        # A client that connects and says nothing must not hold up a scrape.
        idle = socket.create_connection(("127.0.0.1", port))
        s = scrape(http.client.HTTPConnection("127.0.0.1", port, timeout=10))
        stats = {e["node-name"]: e["stats"] for e in
                 ok(q.cmd_raw("query-blockstats", {"query-nodes": True}))}
        disk = stats["disk"]
        assert s[("stord_node_operations_total", "disk", "read")] == disk["rd_operations"] == 2048
        assert s[("stord_node_operations_total", "disk", "write")] == disk["wr_operations"] == 1024
        assert s[("stord_node_operations_total", "disk", "flush")] == disk["flush_operations"] > 0
        assert s[("stord_node_bytes_total", "disk", "read")] == disk["rd_bytes"] == 8 << 20
        assert s[("stord_node_bytes_total", "disk", "write")] == 4 << 20
        assert s[("stord_node_write_highest_offset_bytes", "disk", None)] == \
            disk["wr_highest_offset"]
        assert abs(s[("stord_node_time_seconds_total", "disk", "read")]
                   - disk["rd_total_time_ns"] / 1e9) < 1e-6
        assert s[("stord_node_operations_total", "f", "write")] == stats["f"]["wr_operations"] > 0
        # Added at run time on a unix socket; gone with object-del.
        msock = common.path("me-metrics.sock")
        ok(q.cmd_raw("object-add", {"qom-type": "metrics", "id": "m1",
                                    "addr": {"type": "unix", "path": msock}}))
        s2 = scrape(UnixHTTP(msock))
        assert s2[("stord_node_operations_total", "disk", "read")] == 2048
        objects = {x["name"]: x["type"] for x in ok(q.cmd_raw("qom-list", {"path": "/objects"}))}
        assert objects.get("m0") == objects.get("m1") == "child<metrics>", objects
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("POST", "/metrics", body="x")
        assert c.getresponse().status == 405
        c.close()
        ok(q.cmd_raw("object-del", {"id": "m1"}))
        assert not os.path.exists(msock)
        r = q.cmd_raw("object-add", {"qom-type": "metrics", "id": "m0",
                                     "addr": {"type": "unix", "path": msock}})
        assert "error" in r, r
        idle.close()
        time.sleep(0.1)
        q.close()
    finally:
        d.stop()


if __name__ == "__main__":
    common.main(test)
