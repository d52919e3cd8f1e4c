"""blockdev-add that cannot open a node answers with qsd's error, class and text byte for
byte: a missing file (top-level, and inline under raw and qcow2, where the text is the
file node's own), a child node that does not exist, and an option nobody takes. QEMU does
not prefix a QMP error with the command's name, nor does strerror's text carry the
"(os error N)" that Rust's adds."""

import common

MISSING = common.path("no-such-dir/disk.img")

COMMANDS = [
    {"driver": "file", "node-name": "a", "filename": MISSING},
    {"driver": "raw", "node-name": "b", "file": {"driver": "file", "filename": MISSING}},
    {"driver": "qcow2", "node-name": "c", "file": {"driver": "file", "filename": MISSING}},
    {"driver": "raw", "node-name": "d", "file": "no-such-node"},
    {"driver": "null-co", "node-name": "e", "no-such-option": 1},
]


def errors(binary, tag):
    d = common.Daemon([], binary=binary, tag=tag)
    try:
        q = d.qmp()
        out = [q.cmd_raw("blockdev-add", c).get("error") for c in COMMANDS]
        q.close()
    finally:
        d.stop()
    return out


def test():
    theirs = errors("qemu-storage-daemon", "qsd")
    ours = errors(common.STORD, "stord")
    for cmd, t, o in zip(COMMANDS, theirs, ours):
        assert t is not None, f"qsd accepted {cmd}"
        assert o == t, f"{cmd}: stord answered {o}, qsd {t}"
    assert "No such file or directory" in theirs[0]["desc"], theirs[0]


common.main(test)
