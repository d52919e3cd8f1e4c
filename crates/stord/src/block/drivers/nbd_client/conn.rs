//! One negotiated NBD connection in transmission: many requests in flight, matched to
//! their replies by handle.
//!
//! Any loop may issue a request. It sends its header (and write data) itself with one
//! non-blocking writev under the connection's send lock, so the common request costs no
//! hand-over; what the socket does not take goes to a backlog that the connection's
//! sender task writes through the ring of the connection's own loop. That loop's receiver
//! task reads every reply, fills the request's slot (read data straight into its buffer)
//! and wakes the request's task, which is a cross-thread wake-up when the request came
//! from another loop. When the connection fails, every request in flight ends as `Lost`
//! and the driver decides whether to wait for a reconnect or fail it.
//!
//! Over TLS the same shape holds with the session as the backlog: a request encrypts its
//! header and data into the session under the send lock and writes what records the
//! socket takes; the sender task writes the rest when the socket has room.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use super::handshake::{ExportInfo, Tls};
use crate::block::node::block_node::BlockStatus;
use crate::buf::Buf;
use crate::nbd_wire::io::{send_all, write_records, OutChunk, SharedTls, SockReader};
use crate::nbd_wire::proto::*;

/// How a request ended.
pub(super) enum Outcome {
    /// The server answered (an error it sent is in the result).
    Done(io::Result<Reply>),
    /// The connection failed before the answer: the request may be sent again.
    Lost,
}

/// What a successful reply carries besides the read data.
#[derive(Debug, Default)]
pub(super) struct Reply {
    /// The first extent, for block status.
    pub status: Option<BlockStatus>,
}

/// A request as the driver issues it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request {
    pub cmd: u16,
    pub flags: u16,
    pub offset: u64,
    pub len: u32,
}

/// A request in flight, shared by its task and the receiver.
struct Slot {
    req: Request,
    /// When it was sent (monotonic ns), for the request timeout.
    sent_at: u64,
    st: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// Set once the request is over.
    done: Option<Result<(), io::Error>>,
    lost: bool,
    /// A read's buffer (out while the receiver fills it).
    buf: Option<Buf>,
    /// Bytes of a read the server has described (data or hole chunks), and the ranges,
    /// which may not overlap (a server repeating a chunk would leave bytes unread).
    covered: u64,
    ranges: std::collections::BTreeMap<u64, u64>,
    /// The receiver has the read's buffer out: a loss waits until it is back.
    filling: bool,
    /// The first error chunk's errno.
    error: Option<io::Error>,
    status: Option<BlockStatus>,
    waker: Option<Waker>,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, r: Result<(), io::Error>) {
        let w = {
            let mut s = self.lock();
            s.done = Some(r);
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }

    fn lose(&self) {
        let w = {
            let mut s = self.lock();
            s.lost = true;
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// Bytes the sender task still has to write, in order.
#[derive(Default)]
struct Tx {
    backlog: Vec<u8>,
    /// The sender is writing a backlog (or the session's records) now: new requests
    /// queue behind it.
    sending: bool,
    /// Over TLS: the session holds records the socket did not take.
    records_waiting: bool,
    closed: bool,
    waker: Option<Waker>,
}

/// A connected socket.
pub(super) enum Sock {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

impl Sock {
    fn raw(&self) -> RawFd {
        match self {
            Sock::Unix(s) => s.as_raw_fd(),
            Sock::Tcp(s) => s.as_raw_fd(),
        }
    }

    fn shutdown(&self) {
        let _ = match self {
            Sock::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Sock::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// A connection in transmission.
pub(super) struct Conn {
    sock: Sock,
    /// The TLS session negotiated on the socket, if any.
    tls: Option<SharedTls>,
    pub info: ExportInfo,
    next_handle: AtomicU64,
    tx: Mutex<Tx>,
    pending: Mutex<HashMap<u64, Arc<Slot>>>,
    dead: AtomicBool,
    /// When the receiver last finished a reply or chunk (monotonic ns), for the timeout.
    last_rx: AtomicU64,
    /// How long a request may wait for its reply before the connection is given up
    /// (`x-request-timeout`; none: as long as it takes, as QEMU's client).
    timeout: Option<std::time::Duration>,
}

/// Largest block-status or error payload we read from a reply (a REQ_ONE answer is 12
/// bytes; a server that sends megabytes of extents is cut off).
const MAX_META_PAYLOAD: u32 = 1 << 20;

fn protocol(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("NBD protocol error: {what}"),
    )
}

/// The host errno for an NBD error number (unknown ones are EINVAL, as QEMU maps them).
fn host_errno(e: u32) -> io::Error {
    let n = match e {
        EPERM => libc::EPERM,
        EIO => libc::EIO,
        ENOMEM => libc::ENOMEM,
        ENOSPC => libc::ENOSPC,
        EOVERFLOW => libc::EOVERFLOW,
        ENOTSUP => libc::ENOTSUP,
        ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EINVAL,
    };
    io::Error::from_raw_os_error(n)
}

impl Conn {
    /// A connection over a negotiated non-blocking socket (and its TLS session); its tasks
    /// are started with [`Conn::start`].
    pub fn new(
        sock: Sock,
        info: ExportInfo,
        tls: Tls,
        timeout: Option<std::time::Duration>,
    ) -> Arc<Self> {
        Arc::new(Conn {
            sock,
            tls: tls.map(SharedTls::new),
            info,
            next_handle: AtomicU64::new(1),
            tx: Mutex::default(),
            pending: Mutex::default(),
            dead: AtomicBool::new(false),
            last_rx: AtomicU64::new(0),
            timeout,
        })
    }

    /// Starts the sender and receiver tasks (and the watchdog, with a request timeout) on
    /// `remote`'s loop.
    pub fn start(self: &Arc<Self>, remote: &stord_aio::Remote) {
        let c = self.clone();
        remote.call(move || {
            if let Some(t) = c.timeout {
                stord_aio::spawn_detached(watchdog(c.clone(), t));
            }
            stord_aio::spawn_detached(receiver(c.clone()));
            stord_aio::spawn_detached(sender(c));
        });
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn tx(&self) -> MutexGuard<'_, Tx> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the connection: the socket is shut down (the receiver sees the end), the
    /// sender stops, and every request in flight is `Lost`.
    pub fn fail(&self, why: &str) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(target: "stord::nbd", "NBD connection ended: {why}");
        let w = {
            let mut tx = self.tx();
            tx.closed = true;
            tx.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
        self.sock.shutdown();
        let lost: Vec<_> = self.pending().drain().map(|(_, s)| s).collect();
        for s in lost {
            s.lose();
        }
    }

    /// Says goodbye (NBD_CMD_DISC) if the socket takes it now, then ends the connection.
    pub fn disconnect(&self) {
        if !self.is_dead() {
            let tx = self.tx();
            if tx.backlog.is_empty() && !tx.sending && !tx.closed {
                let hdr = header(
                    Request {
                        cmd: CMD_DISC,
                        flags: 0,
                        offset: 0,
                        len: 0,
                    },
                    0,
                );
                match &self.tls {
                    Some(tls) => {
                        let mut s = tls.lock();
                        if s.write_plain(&[io::IoSlice::new(&hdr)]).is_ok() {
                            let _ = write_records(&mut **s, self.sock.raw());
                        }
                    }
                    None => {
                        let _ = stord_aio::sys::writev_now(self.sock.raw(), &[&hdr]);
                    }
                }
            }
        }
        self.fail("closed");
    }

    /// Sends `req` (with `data` for a write) and waits for its reply; a read's data lands
    /// in `buf`, which comes back in every case.
    pub async fn call(
        self: &Arc<Self>,
        req: Request,
        data: Option<&[u8]>,
        buf: Option<Buf>,
    ) -> (Outcome, Option<Buf>) {
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot {
            req,
            sent_at: if self.timeout.is_some() {
                stord_aio::sys::now_ns()
            } else {
                0
            },
            st: Mutex::new(SlotState {
                buf,
                ..Default::default()
            }),
        });
        // In the table before the header leaves, so the reply always finds it.
        self.pending().insert(handle, slot.clone());
        if self.is_dead() {
            self.pending().remove(&handle);
            return (Outcome::Lost, slot.lock().buf.take());
        }
        if let Err(e) = self.send(&header(req, handle), data.unwrap_or(&[])) {
            self.fail(&format!("send failed: {e}"));
        }
        std::future::poll_fn(|cx| {
            let mut s = slot.lock();
            if let Some(r) = s.done.take() {
                let status = s.status.take();
                return Poll::Ready((Outcome::Done(r.map(|()| Reply { status })), s.buf.take()));
            }
            if s.lost && !s.filling {
                return Poll::Ready((Outcome::Lost, s.buf.take()));
            }
            s.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Writes a request: straight to the socket when nothing is queued before it, else
    /// (or for what the socket does not take) into the sender's backlog.
    fn send(&self, hdr: &[u8], data: &[u8]) -> io::Result<()> {
        let mut tx = self.tx();
        if tx.closed {
            return Ok(()); // fail() already lost the request
        }
        if let Some(tls) = &self.tls {
            let mut s = tls.lock();
            s.write_plain(&[io::IoSlice::new(hdr), io::IoSlice::new(data)])?;
            // A sender at work writes these records after the ones before them.
            if tx.sending || write_records(&mut **s, self.sock.raw())? {
                return Ok(());
            }
            drop(s);
            tx.records_waiting = true;
            if let Some(w) = tx.waker.take() {
                drop(tx);
                w.wake();
            }
            return Ok(());
        }
        let mut sent = 0;
        if tx.backlog.is_empty() && !tx.sending {
            match stord_aio::sys::writev_now(self.sock.raw(), &[hdr, data]) {
                Ok(n) => sent = n,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let total = hdr.len() + data.len();
        if sent == total {
            return Ok(());
        }
        if sent < hdr.len() {
            tx.backlog.extend_from_slice(&hdr[sent..]);
            tx.backlog.extend_from_slice(data);
        } else {
            tx.backlog.extend_from_slice(&data[sent - hdr.len()..]);
        }
        if let Some(w) = tx.waker.take() {
            drop(tx);
            w.wake();
        }
        Ok(())
    }
}

/// The 28-byte request header.
fn header(r: Request, handle: u64) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&r.flags.to_be_bytes());
    h[6..8].copy_from_slice(&r.cmd.to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h[16..24].copy_from_slice(&r.offset.to_be_bytes());
    h[24..28].copy_from_slice(&r.len.to_be_bytes());
    h
}

/// What the sender was woken for.
enum Work {
    Backlog(Vec<u8>),
    Records,
}

/// Writes the backlog, or the TLS records the socket did not take, on the connection's
/// loop.
async fn sender(c: Arc<Conn>) {
    loop {
        let work = std::future::poll_fn(|cx| {
            let mut tx = c.tx();
            if tx.closed {
                return Poll::Ready(None);
            }
            if tx.records_waiting {
                tx.records_waiting = false;
                tx.sending = true;
                return Poll::Ready(Some(Work::Records));
            }
            if tx.backlog.is_empty() {
                tx.sending = false;
                tx.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
            tx.sending = true;
            Poll::Ready(Some(Work::Backlog(std::mem::take(&mut tx.backlog))))
        })
        .await;
        let r = match work {
            None => return,
            Some(Work::Backlog(batch)) => {
                send_all(c.sock.raw(), &mut vec![OutChunk::Bytes(batch)]).await
            }
            Some(Work::Records) => write_all_records(&c).await,
        };
        if let Err(e) = r {
            c.fail(&format!("send failed: {e}"));
            return;
        }
    }
}

/// Writes the session's records as the socket makes room, until none is left; requests
/// add theirs meanwhile (`sending` is set, so they leave the writing to us).
async fn write_all_records(c: &Conn) -> io::Result<()> {
    let tls = c.tls.as_ref().expect("records come from a session");
    loop {
        stord_aio::op::poll_add(c.sock.raw(), stord_aio::Interest::WRITABLE).await?;
        // The send lock first, as requests take it: none adds records while we look.
        let mut tx = c.tx();
        if write_records(&mut **tls.lock(), c.sock.raw())? {
            tx.sending = false;
            return Ok(());
        }
    }
}

/// Gives the connection up when requests are waiting and nothing has come back for
/// `timeout`: no reply since the oldest of them was sent, or since the last reply (a
/// server that stalls without closing: the kernel still acknowledges its bytes, so
/// nothing else would notice). A server that keeps answering is never cut off, however
/// long one request takes among the others. Its requests are then lost like on any failure: sent
/// again after a reconnect within `reconnect-delay`, else failed with EIO.
async fn watchdog(c: Arc<Conn>, timeout: std::time::Duration) {
    // A few looks per timeout: a request fails between 1 and 1.25 timeouts late.
    let period = (timeout / 4).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(1),
    );
    let limit = timeout.as_nanos() as u64;
    while !c.is_dead() {
        stord_aio::sleep(period).await;
        let oldest = c.pending().values().map(|s| s.sent_at).min();
        if let Some(t) = oldest {
            let since = t.max(c.last_rx.load(Ordering::Relaxed));
            if stord_aio::sys::now_ns().saturating_sub(since) > limit {
                c.fail(&format!(
                    "no reply from the server within {} s",
                    timeout.as_secs_f64()
                ));
            }
        }
    }
}

/// Reads replies until the connection ends, on the connection's loop.
async fn receiver(c: Arc<Conn>) {
    // The server is our storage: its replies teach the loop's storage poll window.
    let mut r = SockReader::new(c.sock.raw(), Vec::new()).on_storage();
    if let Some(tls) = &c.tls {
        // Anything the negotiation received past its end is still in the session.
        r = r.with_tls(tls.clone(), Vec::new());
    }
    let e = loop {
        if let Err(e) = reply(&c, &mut r).await {
            break e;
        }
        if c.timeout.is_some() {
            c.last_rx.store(stord_aio::sys::now_ns(), Ordering::Relaxed);
        }
    };
    c.fail(&e.to_string());
}

/// The slot of `handle`, removed from the table when `last`.
fn slot_of(c: &Conn, handle: u64, last: bool) -> io::Result<Arc<Slot>> {
    let mut p = c.pending();
    let s = if last {
        p.remove(&handle)
    } else {
        p.get(&handle).cloned()
    };
    s.ok_or_else(|| protocol("reply to a request we did not send"))
}

/// Receives `len` bytes into a read's buffer at `at` (the buffer leaves the slot while
/// the socket fills it).
async fn read_into(r: &mut SockReader, slot: &Slot, at: usize, len: usize) -> io::Result<()> {
    let buf = {
        let mut s = slot.lock();
        s.filling = true;
        s.buf.take()
    };
    let Some(buf) = buf else {
        slot.lock().filling = false;
        return Err(protocol("read data for a request without a buffer"));
    };
    let (res, buf) = r.read_into(buf, at, at + len).await;
    // Back in the slot before anyone may see the request end (a loss meanwhile waited).
    let w = {
        let mut s = slot.lock();
        s.buf = Some(buf);
        s.filling = false;
        if s.lost {
            s.waker.take()
        } else {
            None
        }
    };
    if let Some(w) = w {
        w.wake();
    }
    res
}

/// Records that a read chunk described `[at, at + n)` of the request; a chunk that
/// overlaps one before it is a protocol error.
fn cover(slot: &Slot, at: u64, n: u64) -> io::Result<()> {
    let mut s = slot.lock();
    let before = s.ranges.range(..at + n).next_back().map(|(&a, &e)| (a, e));
    if matches!(before, Some((_, end)) if end > at) {
        return Err(protocol("read chunks overlap"));
    }
    s.ranges.insert(at, at + n);
    s.covered += n;
    Ok(())
}

/// Ends a request whose reply failed half way once its slot has left the table (the
/// connection's failure cannot reach it there): a protocol error fails it with EIO, a lost
/// connection makes it `Lost` (sent again after a reconnect).
fn end_on_error(slot: &Slot, e: &io::Error) {
    if e.kind() == io::ErrorKind::InvalidData {
        slot.finish(Err(io::Error::from_raw_os_error(libc::EIO)));
    } else {
        slot.lose();
    }
}

/// Reads and handles one reply (a simple reply, or one structured chunk).
async fn reply(c: &Conn, r: &mut SockReader) -> io::Result<()> {
    r.ensure(4).await?;
    let magic = u32::from_be_bytes(r.buffered()[..4].try_into().expect("4 bytes"));
    if magic == SIMPLE_REPLY_MAGIC {
        r.ensure(16).await?;
        let h = r.consume(16);
        let err = u32::from_be_bytes(h[4..8].try_into().expect("4 bytes"));
        let handle = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        let slot = slot_of(c, handle, true)?;
        if err != 0 {
            slot.finish(Err(host_errno(err)));
            return Ok(());
        }
        if slot.req.cmd == CMD_READ {
            let r = if c.info.structured {
                Err(protocol("simple reply with data to a structured read"))
            } else {
                read_into(r, &slot, 0, slot.req.len as usize).await
            };
            if let Err(e) = r {
                end_on_error(&slot, &e);
                return Err(e);
            }
        }
        slot.finish(Ok(()));
        return Ok(());
    }
    if magic != STRUCTURED_REPLY_MAGIC || !c.info.structured {
        return Err(protocol("bad reply magic"));
    }
    r.ensure(20).await?;
    let h = r.consume(20);
    let flags = u16::from_be_bytes([h[4], h[5]]);
    let ty = u16::from_be_bytes([h[6], h[7]]);
    let handle = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
    let done = flags & REPLY_FLAG_DONE != 0;
    let slot = slot_of(c, handle, done)?;
    if let Err(e) = chunk(c, r, &slot, ty, len, done).await {
        if done {
            end_on_error(&slot, &e);
        }
        return Err(e);
    }
    Ok(())
}

/// Handles one structured chunk for `slot` (ended here when `done`).
async fn chunk(
    c: &Conn,
    r: &mut SockReader,
    slot: &Slot,
    ty: u16,
    len: u32,
    done: bool,
) -> io::Result<()> {
    let req = slot.req;
    match ty {
        REPLY_TYPE_NONE if len == 0 && done => {}
        REPLY_TYPE_OFFSET_DATA if req.cmd == CMD_READ && len > 8 => {
            r.ensure(8).await?;
            let off = u64::from_be_bytes(r.consume(8).try_into().expect("8 bytes"));
            let n = u64::from(len - 8);
            let at = chunk_at(req, off, n)?;
            cover(slot, at as u64, n)?;
            read_into(r, slot, at, n as usize).await?;
        }
        REPLY_TYPE_OFFSET_HOLE if req.cmd == CMD_READ && len == 12 => {
            r.ensure(12).await?;
            let off = u64::from_be_bytes(r.consume(8).try_into().expect("8 bytes"));
            let n: u64 = u32::from_be_bytes(r.consume(4).try_into().expect("4 bytes")).into();
            let at = chunk_at(req, off, n)?;
            cover(slot, at as u64, n)?;
            if let Some(buf) = slot.lock().buf.as_mut() {
                buf[at..at + n as usize].fill(0);
            }
        }
        REPLY_TYPE_BLOCK_STATUS if req.cmd == CMD_BLOCK_STATUS => {
            if !(12..=MAX_META_PAYLOAD).contains(&len) || !(len - 4).is_multiple_of(8) {
                return Err(protocol("bad block status chunk length"));
            }
            let b = r.read_vec(len as usize).await?;
            let [ctx, ext_len, ext_flags] =
                [0, 4, 8].map(|at| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes")));
            if Some(ctx) != c.info.context || ext_len == 0 {
                return Err(protocol("block status for a context we did not ask for"));
            }
            slot.lock().status = Some(BlockStatus {
                len: u64::from(ext_len).min(u64::from(req.len)),
                allocated: ext_flags & STATE_HOLE == 0,
                zero: ext_flags & STATE_ZERO != 0,
            });
        }
        t if t & (1 << 15) != 0 => {
            if !(6..=MAX_META_PAYLOAD).contains(&len) {
                return Err(protocol("bad error chunk length"));
            }
            let b = r.read_vec(len as usize).await?;
            let err = match u32::from_be_bytes(b[..4].try_into().expect("4 bytes")) {
                // The spec forbids 0 in an error chunk; treat it as EIO, as QEMU does.
                0 => EIO,
                e => e,
            };
            let msg_len = usize::from(u16::from_be_bytes([b[4], b[5]]));
            if 6 + msg_len > b.len() {
                return Err(protocol("error message beyond its chunk"));
            }
            let msg = String::from_utf8_lossy(&b[6..6 + msg_len]);
            if !msg.is_empty() {
                tracing::debug!(target: "stord::nbd", "server error: {msg}");
            }
            let mut s = slot.lock();
            if s.error.is_none() {
                s.error = Some(host_errno(err));
            }
        }
        _ => return Err(protocol("unexpected structured reply chunk")),
    }
    if done {
        end_reply(slot, req);
    }
    Ok(())
}

/// The request's last chunk has come: it ends with the first error a chunk reported, or
/// with what its chunks left missing.
fn end_reply(slot: &Slot, req: Request) {
    let res = {
        let mut s = slot.lock();
        match s.error.take() {
            Some(e) => Err(e),
            None if req.cmd == CMD_READ && s.covered < u64::from(req.len) => {
                Err(io::Error::other("NBD server sent an incomplete read"))
            }
            None if req.cmd == CMD_BLOCK_STATUS && s.status.is_none() => {
                Err(io::Error::other("NBD server sent no block status"))
            }
            None => Ok(()),
        }
    };
    slot.finish(res);
}

/// Where a read chunk for `[off, off + n)` lands in the request's buffer.
fn chunk_at(req: Request, off: u64, n: u64) -> io::Result<usize> {
    match off.checked_sub(req.offset) {
        Some(at) if n > 0 && at + n <= u64::from(req.len) => Ok(at as usize),
        _ => Err(protocol("read chunk outside its request")),
    }
}
