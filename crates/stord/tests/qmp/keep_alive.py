"""TCP keep-alive on both NBD ends: InetSocketAddress's `keep-alive` and QEMU 10.1's
`keep-alive-count`, `keep-alive-idle` and `keep-alive-interval`, set on the sockets and
read back from the daemon's own descriptors (pidfd_getfd, then getsockopt).

Side by side with qsd 10.0 where it has them: the NBD client node's `server.keep-alive`
sets SO_KEEPALIVE on its connection in both (and not without it); a unix address refuses
the member in the same words. For the 10.1 members, against the schema text and QEMU's
util/qemu-sockets.c (inet_set_sockopts): qsd 10.0 refuses them as unexpected; stord sets
TCP_KEEPCNT, TCP_KEEPIDLE and TCP_KEEPINTVL, only with `keep-alive=on` (0 leaves the
system's value), on the client's connection and on the server's listening socket, whose
accepted connections inherit them (QEMU 10.1 sets them there too; qsd 10.0 takes
`keep-alive` on a listening address and leaves the socket as it is)."""

import ctypes
import os
import socket
import time

import common
from common import ok, err

SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438
libc = ctypes.CDLL(None, use_errno=True)


def tcp_sockets(pid):
    """The daemon's TCP sockets, as duplicates of its descriptors."""
    pfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    assert pfd >= 0, os.strerror(ctypes.get_errno())
    out, seen = [], set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            # One entry per socket: the epoll reactor waits on a duplicate of a descriptor.
            if not link.startswith("socket:") or link in seen:
                continue
            seen.add(link)
            n = libc.syscall(SYS_PIDFD_GETFD, pfd, int(fd), 0)
            assert n >= 0, os.strerror(ctypes.get_errno())
            s = socket.socket(fileno=n)
            if s.family in (socket.AF_INET, socket.AF_INET6):
                out.append(s)
            else:
                s.detach()
                os.close(n)
    finally:
        os.close(pfd)
    return out


def opts(s):
    return (s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL))


def peer(s):
    try:
        return s.getpeername()[1]
    except OSError:
        return None


def server(binary, tag):
    """A daemon with a null node, for an NBD server to be started on."""
    return common.Daemon(["--blockdev", "driver=null-co,node-name=n,size=1048576"],
                         binary=binary, tag=tag)


def client(binary, tag, port, extra=""):
    """A daemon with an NBD client node connected to 127.0.0.1:port: its connection's
    keep-alive options."""
    d = common.Daemon([
        "--blockdev", "driver=nbd,node-name=c,server.type=inet,server.host=127.0.0.1,"
                      f"server.port={port},export=e,read-only=on{extra}",
    ], binary=binary, tag=tag)
    try:
        conns = [s for s in tcp_sockets(d.proc.pid) if peer(s) == port]
        assert len(conns) == 1, conns
        return opts(conns[0])
    finally:
        d.stop()


def defaults():
    s = socket.socket()
    try:
        return opts(s)
    finally:
        s.close()


def test():
    system = defaults()
    port = 10000 + os.getpid() % 20000
    d = server("qemu-storage-daemon", "qsd")
    try:
        q = d.qmp()
        addr = lambda **m: {"type": "inet", "data": {"host": "127.0.0.1", "port": str(port), **m}}
        err(q.cmd_raw("nbd-server-start", {"addr": addr(**{"keep-alive-count": 3})}),
            contains="Parameter 'addr.data.keep-alive-count' is unexpected")
        unix = err(q.cmd_raw("nbd-server-start", {"addr": {"type": "unix", "data": {
            "path": common.path("ka.sock"), "keep-alive": True}}}))
        ok(q.cmd_raw("nbd-server-start", {"addr": addr(**{"keep-alive": True})}))
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e", "node-name": "n", "name": "e"}))
        # The NBD client, in both daemons: keep-alive only when asked.
        theirs = (client("qemu-storage-daemon", "qsd-c", port),
                  client("qemu-storage-daemon", "qsd-ck", port, ",server.keep-alive=on"))
        ours = (client(common.STORD, "stord-c", port),
                client(common.STORD, "stord-ck", port, ",server.keep-alive=on"))
        assert theirs == ours, (theirs, ours)
        assert ours == (system, (1,) + system[1:]), ours
        # The 10.1 members on the client's connection (stord).
        assert client(common.STORD, "stord-ckn", port,
                      ",server.keep-alive=on,server.keep-alive-count=4,"
                      "server.keep-alive-idle=30,server.keep-alive-interval=7") == (1, 4, 30, 7)
        # Without keep-alive=on they change nothing (inet_set_sockopts).
        assert client(common.STORD, "stord-cn", port,
                      ",server.keep-alive-count=4,server.keep-alive-idle=30") == system
        q.close()
    finally:
        d.stop()

    port += 1
    d = server(common.STORD, "stord")
    try:
        q = d.qmp()
        addr = lambda **m: {"type": "inet", "data": {"host": "127.0.0.1", "port": str(port), **m}}
        assert unix == err(q.cmd_raw("nbd-server-start", {"addr": {"type": "unix", "data": {
            "path": common.path("ka.sock"), "keep-alive": True}}})), unix
        err(q.cmd_raw("nbd-server-start", {"addr": addr(**{"keep-alive-count": 1 << 32})}))
        ok(q.cmd_raw("nbd-server-start", {"addr": addr(**{
            "keep-alive": True, "keep-alive-count": 5, "keep-alive-idle": 60,
            "keep-alive-interval": 9})}))
        ok(q.cmd_raw("block-export-add", {"type": "nbd", "id": "e", "node-name": "n", "name": "e"}))
        c = socket.create_connection(("127.0.0.1", port))
        mine = c.getsockname()[1]
        deadline = time.time() + 5
        while True:
            socks = tcp_sockets(d.proc.pid)
            accepted = [s for s in socks if peer(s) == mine]
            if accepted or time.time() > deadline:
                break
            for s in socks:
                s.close()
            time.sleep(0.05)
        listening = [s for s in socks if peer(s) is None and s.getsockname()[1] == port]
        assert len(listening) == 1 and len(accepted) == 1, (listening, accepted)
        assert opts(listening[0]) == (1, 5, 60, 9), opts(listening[0])
        assert opts(accepted[0]) == (1, 5, 60, 9), opts(accepted[0])
        # Our duplicates would keep the port bound.
        for s in socks:
            s.close()
        c.close()
        ok(q.cmd_raw("nbd-server-stop"))
        # keep-alive off: the 10.1 members are not applied.
        ok(q.cmd_raw("nbd-server-start", {"addr": addr(**{"keep-alive-count": 5})}))
        listening = [s for s in tcp_sockets(d.proc.pid)
                     if peer(s) is None and s.getsockname()[1] == port]
        assert opts(listening[0]) == system, opts(listening[0])
        q.close()
    finally:
        d.stop()

    # The command line's form.
    port += 1
    d = common.Daemon([
        "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={port},"
                        "addr.keep-alive=on,addr.keep-alive-idle=120",
    ])
    try:
        listening = [s for s in tcp_sockets(d.proc.pid) if s.getsockname()[1] == port]
        assert opts(listening[0]) == (1, system[1], 120, system[3]), opts(listening[0])
    finally:
        d.stop()


common.main(test)
