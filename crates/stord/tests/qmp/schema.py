"""query-qmp-schema, generated from stord's command table, describes what stord takes the
way qsd's schema does: every command qsd has, stord has; every command query-commands
lists is there with an argument type
that resolves; for each command both daemons have, stord requires the arguments qsd
requires and names no argument qsd lacks (stord's own extensions listed); and every
argument the schema declares is checked as declared (a wrong type is refused)."""

import common
from common import ok, err

# Arguments stord takes that qsd's schema does not have (stord's own, documented).
OURS = {("nbd-server-start", "x-buffer-limit")}
# Arguments of QEMU 10.1 and later that the installed qsd (10.0) lacks: checked against
# QEMU's schema text instead (qapi/block-core.json).
NEWER = {("blockdev-mirror", "target-is-zero")}


def schema_of(binary, tag):
    d = common.Daemon([], binary=binary, tag=tag)
    try:
        q = d.qmp()
        schema = ok(q.cmd_raw("query-qmp-schema"))
        names = [c["name"] for c in ok(q.cmd_raw("query-commands"))]
        q.close()
    finally:
        d.stop()
    return {e["name"]: e for e in schema}, names


def members(schema, cmd):
    """(required, all) member names of a command's argument type (a union's base and
    every variant's members count as 'all')."""
    t = schema[schema[cmd]["arg-type"]]
    assert t["meta-type"] == "object", (cmd, t)
    req = {m["name"] for m in t["members"] if "default" not in m}
    every = {m["name"] for m in t["members"]}
    for v in t.get("variants", []):
        every |= {m["name"] for m in schema[v["type"]]["members"]}
    return req, every


def test():
    theirs, _ = schema_of("qemu-storage-daemon", "qsd")
    ours, names = schema_of(common.STORD, "stord")
    assert set(names) == {n for n, e in ours.items() if e["meta-type"] == "command"}, names
    for e in ours.values():
        # An enum's members are names only; an object's name their types.
        for m in e.get("members", []) if e["meta-type"] == "object" else []:
            assert m["type"] in ours, f"{e['name']}: member {m['name']} has unknown type"
        if e["meta-type"] in ("command", "event"):
            assert e["arg-type"] in ours, e
    shared = [n for n in names if n in theirs and theirs[n]["meta-type"] == "command"]
    # Every command qsd has, stord has.
    missing = sorted(n for n, e in theirs.items()
                     if e["meta-type"] == "command" and n not in ours)
    assert not missing, f"qsd's commands stord lacks: {missing}"
    problems = []
    for cmd in shared:
        q_req, q_all = members(theirs, cmd)
        s_req, s_all = members(ours, cmd)
        if q_req - s_req:
            problems.append(f"{cmd}: qsd requires {sorted(q_req - s_req)}, stord does not")
        extra = {a for a in s_all - q_all if (cmd, a) not in OURS | NEWER}
        if extra:
            problems.append(f"{cmd}: stord declares {sorted(extra)}, qsd has no such argument")
    assert not problems, problems
    # Events: every one stord sends, qsd sends too, with the same members (neither has
    # SHUTDOWN: a storage daemon has no run state).
    events = [n for n, e in ours.items() if e["meta-type"] == "event"]
    assert "SHUTDOWN" not in events and "BLOCK_EXPORT_DELETED" in events, events
    for ev in events:
        assert ev in theirs, ev
        assert members(ours, ev) == members(theirs, ev), (ev, members(ours, ev), members(theirs, ev))

    newer(ours)

    # The declared types are enforced, with QEMU's message.
    d = common.Daemon([])
    try:
        q = d.qmp()
        err(q.cmd_raw("blockdev-del", {"node-name": 5}),
            contains="Invalid parameter type for 'node-name', expected: string")
        err(q.cmd_raw("block_resize", {"node-name": "x"}), contains="Parameter 'size' is missing")
        err(q.cmd_raw("query-version", {"x": 1}), contains="Parameter 'x' is unexpected")
        err(q.cmd_raw("no-such-command"), cls="CommandNotFound")
        q.close()
    finally:
        d.stop()


def newer(ours):
    """What QEMU 10.1 to 11.1 added is in stord's schema as QEMU's schema text has it:
    qom-list-get (qapi/qom.json: `paths`, a list of strings, required), blockdev-mirror's
    optional `target-is-zero` (block-core.json), nbd-server-start's inet address with
    `keep-alive` and the 10.1 `keep-alive-count`, `-idle`, `-interval` (sockets.json), the
    `monitor-qmp` object type (qom.json's ObjectType, 11.1), and query-named-block-nodes'
    `children` (10.1) and `image.limits` (10.2) in its return type."""
    assert ours["qom-list-get"]["meta-type"] == "command"
    assert members(ours, "qom-list-get") == ({"paths"}, {"paths"})
    req, every = members(ours, "blockdev-mirror")
    assert "target-is-zero" in every and "target-is-zero" not in req
    addr = [m for m in ours[ours["nbd-server-start"]["arg-type"]]["members"]
            if m["name"] == "addr"][0]
    union = ours[addr["type"]]
    assert union["tag"] == "type", union
    inet = [v for v in union["variants"] if v["case"] == "inet"][0]
    data = [m for m in ours[inet["type"]]["members"] if m["name"] == "data"][0]
    names = {m["name"]: "default" in m for m in ours[data["type"]]["members"]}
    for k in ("keep-alive", "keep-alive-count", "keep-alive-idle", "keep-alive-interval"):
        assert names.get(k) is True, (k, names)
    # object-add's qom-type (ObjectType) has 11.1's monitor-qmp.
    qom_type = [m for m in ours[ours["object-add"]["arg-type"]]["members"]
                if m["name"] == "qom-type"][0]
    assert "monitor-qmp" in ours[qom_type["type"]]["values"], ours[qom_type["type"]]
    # query-named-block-nodes returns BlockDeviceInfo with 10.1's `children` (a list of
    # BlockdevChild) and ImageInfo's 10.2 `limits` (BlockLimitsInfo).
    ret = ours[ours["query-named-block-nodes"]["ret-type"]]
    assert ret["meta-type"] == "array", ret
    info = {m["name"]: m for m in ours[ret["element-type"]]["members"]}
    children = ours[info["children"]["type"]]
    assert children["meta-type"] == "array", children
    child = {m["name"] for m in ours[children["element-type"]]["members"]}
    assert child == {"child", "node-name"}, child
    image = {m["name"]: m for m in ours[info["image"]["type"]]["members"]}
    limits = {m["name"] for m in ours[image["limits"]["type"]]["members"]}
    assert {"request-alignment", "max-iov", "opt-mem-alignment"} <= limits, limits


common.main(test)
