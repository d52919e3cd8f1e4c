"""blockdev-reopen of read-only state, transaction and unknown commands: stord answers as
qemu-storage-daemon does (success or error, and the error class), step by step."""

import common
from common import ok


def steps(binary, tag, img, nbd):
    """Runs the same QMP sequence; returns (step, outcome) pairs: 'ok' or the error class."""
    d = common.Daemon([], binary=binary, tag=tag)
    seen = []
    try:
        q = d.qmp()

        def step(name, cmd, **args):
            r = q.cmd_raw(cmd, args)
            seen.append((name, "ok" if "return" in r else r["error"]["class"]))
            return r

        def ro():
            nodes = ok(q.cmd_raw("query-named-block-nodes"))
            return [n["ro"] for n in nodes if n["node-name"] == "disk"][0]

        file_opts = {"driver": "file", "node-name": "disk", "filename": img}
        step("add", "blockdev-add", **file_opts)
        step("server", "nbd-server-start", addr={"type": "unix", "data": {"path": nbd}})
        step("export rw", "block-export-add", type="nbd", id="e", **{"node-name": "disk"},
             writable=True)
        # A writable export holds the node writable.
        step("ro under a writable export", "blockdev-reopen",
             options=[dict(file_opts, **{"read-only": True})])
        assert not ro()
        step("del export", "block-export-del", id="e")
        common.wait_event(q, "BLOCK_EXPORT_DELETED")
        step("ro", "blockdev-reopen", options=[dict(file_opts, **{"read-only": True})])
        seen.append(("ro after", ro()))
        step("rw export of a ro node", "block-export-add", type="nbd", id="e2",
             **{"node-name": "disk"}, writable=True)
        step("ro export of a ro node", "block-export-add", type="nbd", id="e3",
             **{"node-name": "disk"}, writable=False)
        step("del ro export", "block-export-del", id="e3")
        common.wait_event(q, "BLOCK_EXPORT_DELETED")
        # Options left out take their defaults: read-only off.
        step("rw", "blockdev-reopen", options=[file_opts])
        seen.append(("rw after", ro()))
        step("unknown node", "blockdev-reopen",
             options=[dict(file_opts, **{"node-name": "nope"})])
        step("empty transaction", "transaction", actions=[])
        step("abort", "transaction", actions=[{"type": "abort", "data": {}}])
        step("unknown command", "x-no-such-command")
        q.close()
    finally:
        d.stop()
    return seen


def test():
    img = common.sparse("reopen.img", 8 << 20)
    qsd = steps("qemu-storage-daemon", "qsd", img, common.path("reopen-qsd.sock"))
    ours = steps(common.STORD, "stord", img, common.path("reopen-stord.sock"))
    assert ours == qsd, "\n".join(f"{a} | {b}" for a, b in zip(ours, qsd))
    # The sequence really exercised both outcomes.
    outcomes = dict(ours)
    assert outcomes["ro under a writable export"] == "GenericError", ours
    assert outcomes["ro after"] is True and outcomes["rw after"] is False, ours
    assert outcomes["abort"] == "GenericError", ours
    assert outcomes["unknown command"] == "CommandNotFound", ours
    print("steps:", ours)


common.main(test)
