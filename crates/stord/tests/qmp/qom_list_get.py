"""qom-list-get (QEMU 10.1, qapi/qom.json): for each path, its properties with their
values, a value left out where the property cannot be read; an invalid or ambiguous path
fails the whole command. QEMU builds each element as qom-list lists the path and reads
every property as qom-get does (qom/qom-qmp-cmds.c), so the reference is qsd 10.0's own
qom-list and qom-get over the same objects:

- the same paths (the root, the containers, an iothread by partial and absolute path,
  a chardev) give the same property names and types as stord's qom-list, in its order,
  with the values qsd's qom-get reads for the properties both daemons have (an
  iothread's QEMU settings, the type names, the children's canonical paths);
- a path that names nothing fails as qsd's qom-list fails for it, whichever element it
  is; the list of paths is checked as QEMU's schema types it;
- a secret's value is never read back (stord leaves it out; qsd's qom-get would show
  it)."""

import common
from common import ok, err

ARGS = ["--object", "iothread,id=io0,poll-max-ns=1000,poll-grow=3",
        "--object", "secret,id=s0,data=hush",
        "--chardev", "null,id=n0"]
PATHS = ["/", "/objects", "io0", "/objects/io0", "/chardevs", "/chardevs/n0", "s0"]
# The iothread properties QEMU and stord both have, with the same meaning.
IOTHREAD = {"type", "poll-max-ns", "poll-grow", "poll-shrink", "aio-max-batch"}


def qsd_view():
    """qsd 10.0's answer, built as QEMU's qom-list-get builds it."""
    d = common.Daemon(ARGS, binary="qemu-storage-daemon", tag="qsd")
    try:
        q = d.qmp()
        out = {}
        for path in PATHS:
            props = {}
            for p in ok(q.cmd_raw("qom-list", {"path": path})):
                r = q.cmd_raw("qom-get", {"path": path, "property": p["name"]})
                props[p["name"]] = (p["type"], r.get("return"))
            out[path] = props
        missing = q.cmd_raw("qom-list", {"path": "/objects/nope"})
        q.close()
    finally:
        d.stop()
    return out, missing


def test():
    theirs, missing = qsd_view()
    d = common.Daemon(ARGS)
    try:
        q = d.qmp()
        got = ok(q.cmd_raw("qom-list-get", {"paths": PATHS}))
        assert len(got) == len(PATHS), got
        for path, element in zip(PATHS, got):
            assert list(element) == ["properties"], element
            listed = ok(q.cmd_raw("qom-list", {"path": path}))
            props = element["properties"]
            # qom-list's names and types, in its order.
            assert [(p["name"], p["type"]) for p in props] == \
                [(p["name"], p["type"]) for p in listed], (path, props, listed)
            for p in props:
                assert set(p) <= {"name", "type", "value"}, p
                name = p["name"]
                if name not in theirs[path] or "value" not in p:
                    continue
                if path in ("io0", "/objects/io0") and name not in IOTHREAD:
                    continue
                assert theirs[path][name] == (p["type"], p["value"]), \
                    (path, name, theirs[path][name], p)
            # The values both read: the types, the children's paths, the settings.
            values = {p["name"]: p.get("value") for p in props}
            assert values["type"] == theirs[path]["type"][1], (path, values)
        io0 = {p["name"]: p.get("value") for p in got[2]["properties"]}
        assert (io0["poll-max-ns"], io0["poll-grow"]) == (1000, 3), io0
        assert {p["name"]: p.get("value") for p in got[1]["properties"]}["io0"] == "/objects/io0"
        secret = got[PATHS.index("s0")]["properties"]
        assert all("value" not in p for p in secret if p["name"] != "type"), secret
        assert theirs["s0"]["data"][1] == "hush"
        # A path that names nothing: qsd's error for it, wherever it is in the list.
        for paths in (["/objects/nope"], ["/", "/objects/nope", "io0"]):
            r = q.cmd_raw("qom-list-get", {"paths": paths})
            assert r["error"] == missing["error"], (r, missing)
        assert ok(q.cmd_raw("qom-list-get", {"paths": []})) == []
        err(q.cmd_raw("qom-list-get", {"paths": ["/", 3]}),
            contains="Invalid parameter type for 'paths[1]', expected: string")
        err(q.cmd_raw("qom-list-get", {}), contains="Parameter 'paths' is missing")
        q.close()
    finally:
        d.stop()


common.main(test)
