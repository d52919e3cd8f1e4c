"""Commands that cannot open or find what they name answer with qsd's error, class and
text byte for byte: blockdev-add of a missing file (top-level, and inline under raw and
qcow2, where the text is the file node's own), of a child node that does not exist, with
an option nobody takes, and with aio=native on a file opened without O_DIRECT; object-add
of a secret with neither data nor file, or with both; block-export-add on an iothread
that does not exist. QEMU does not prefix a QMP error with the command's name, nor does
strerror's text carry the "(os error N)" that Rust's adds."""

import common

MISSING = common.path("no-such-dir/disk.img")
# A file of the test's own: qsd opens a file before it checks aio=native, stord after, so
# the texts agree only for a file both can open read-write.
PLAIN = common.path("plain.img")

COMMANDS = [
    ("blockdev-add", {"driver": "file", "node-name": "a", "filename": MISSING}),
    ("blockdev-add", {"driver": "raw", "node-name": "b",
                      "file": {"driver": "file", "filename": MISSING}}),
    ("blockdev-add", {"driver": "qcow2", "node-name": "c",
                      "file": {"driver": "file", "filename": MISSING}}),
    ("blockdev-add", {"driver": "raw", "node-name": "d", "file": "no-such-node"}),
    ("blockdev-add", {"driver": "null-co", "node-name": "e", "no-such-option": 1}),
    ("blockdev-add", {"driver": "file", "node-name": "f", "filename": PLAIN, "aio": "native"}),
    ("object-add", {"qom-type": "secret", "id": "s0"}),
    ("object-add", {"qom-type": "secret", "id": "s1", "data": "a", "file": PLAIN}),
    ("blockdev-add", {"driver": "null-co", "node-name": "n"}),
    ("block-export-add", {"type": "nbd", "id": "x", "node-name": "n", "iothread": "nope"}),
]


def replies(binary, tag):
    d = common.Daemon([], binary=binary, tag=tag)
    try:
        q = d.qmp()
        out = [q.cmd_raw(cmd, args) for cmd, args in COMMANDS]
        q.close()
    finally:
        d.stop()
    return out


def test():
    common.sparse("plain.img", 1 << 20)
    theirs = replies("qemu-storage-daemon", "qsd")
    ours = replies(common.STORD, "stord")
    for cmd, t, o in zip(COMMANDS, theirs, ours):
        assert o == t, f"{cmd}: stord answered {o}, qsd {t}"
    assert sum("error" in t for t in theirs) == len(COMMANDS) - 1, theirs
    assert "No such file or directory" in theirs[0]["error"]["desc"], theirs[0]


common.main(test)
