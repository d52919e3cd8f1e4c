"""The same command line under qemu-storage-daemon and stord gives the same
query-block-exports and query-named-block-nodes shape for the fields both have."""

import common
from common import ok

# Fields whose values must agree too, not only their types.
SAME_VALUE = {"node-name", "drv", "ro", "file", "encrypted", "backing_file_depth",
              "detect_zeroes", "virtual-size", "filename", "direct", "no-flush", "writeback",
              "type", "id", "shutting-down"}


def shape_diff(a, b, where, problems, missing):
    if isinstance(a, dict) and isinstance(b, dict):
        for k, va in a.items():
            if k not in b:
                missing.append(f"{where}.{k}")
                continue
            shape_diff(va, b[k], f"{where}.{k}", problems, missing)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            problems.append(f"{where}: {len(a)} vs {len(b)} entries")
        for i, (x, y) in enumerate(zip(a, b)):
            shape_diff(x, y, f"{where}[{i}]", problems, missing)
        return
    if type(a) is not type(b):
        problems.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
    elif where.rsplit(".", 1)[-1] in SAME_VALUE and a != b:
        problems.append(f"{where}: {a!r} vs {b!r}")


def run(binary, tag, img, nbd, base, top):
    args = ["--object", "iothread,id=io0",
            "--blockdev", f"driver=file,node-name=basef,filename={base}",
            "--blockdev", "driver=qcow2,node-name=base,file=basef,read-only=on",
            "--blockdev", f"driver=file,node-name=topf,filename={top}",
            "--blockdev", "driver=qcow2,node-name=top,file=topf,backing=base,detect-zeroes=on",
            "--blockdev", f"driver=file,node-name=disk,filename={img},aio=io_uring,cache.direct=on",
            "--blockdev", "driver=null-co,node-name=nul,size=1048576",
            "--nbd-server", f"addr.type=unix,addr.path={nbd}",
            "--export", "type=nbd,id=exp0,node-name=disk,name=disk,writable=on,iothread=io0",
            "--export", "type=nbd,id=exp1,node-name=nul,name=nul"]
    d = common.Daemon(args, binary=binary, tag=tag)
    try:
        q = d.qmp()
        exports = ok(q.cmd_raw("query-block-exports"))
        nodes = ok(q.cmd_raw("query-named-block-nodes"))
        q.close()
    finally:
        d.stop()
    key = lambda x: x.get("id", x.get("node-name"))
    return sorted(exports, key=key), sorted(nodes, key=key)


def test():
    img = common.sparse("compare.img", 8 << 20)
    import subprocess
    base, top = common.path("cmp-base.qcow2"), common.path("cmp-top.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", base, "16M"], check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", top],
                   check=True)
    qsd_e, qsd_n = run("qemu-storage-daemon", "qsd", img, common.path("cmp-qsd.sock"), base, top)
    st_e, st_n = run(common.STORD, "stord", img, common.path("cmp-stord.sock"), base, top)
    # The qcow2 chain: the fields both report, with the values QEMU gives them (the
    # backing chain's depth, detect-zeroes as set).
    by = lambda nodes: {n["node-name"]: n for n in nodes}
    qn, sn = by(qsd_n), by(st_n)
    for name in ("top", "base"):
        for k in ("node-name", "drv", "ro", "encrypted", "backing_file_depth", "detect_zeroes"):
            assert qn[name][k] == sn[name][k], (name, k, qn[name][k], sn[name][k])
    qsd_n = [qn["disk"], qn["nul"]]
    st_n = [sn["disk"], sn["nul"]]
    problems, missing = [], []
    shape_diff(qsd_e, st_e, "query-block-exports", problems, missing)
    assert not missing, f"stord lacks fields qsd has: {missing}"
    # Nodes: compare the file node fully; the null node's image details differ by design
    # (qsd describes null-co with a json: filename), so compare its core fields only.
    shape_diff(qsd_n[0], st_n[0], "query-named-block-nodes[disk]", problems, missing)
    core = {k: qsd_n[1][k] for k in ("node-name", "drv", "ro", "encrypted", "backing_file_depth", "cache")}
    shape_diff(core, st_n[1], "query-named-block-nodes[nul]", problems, missing)
    # Fields qsd has that we do not: allowed only for these (format-specific details).
    allowed = {"query-named-block-nodes[disk].image.format-specific"}
    unexpected = [m for m in missing if m not in allowed]
    assert not problems, problems
    assert not unexpected, f"stord lacks fields qsd has: {unexpected}"
    print("fields only qsd reports:", missing)


common.main(test)
