//! The transmission phase: requests read in bulk, one task per request, replies coalesced.
//!
//! A connection runs three kinds of task on its export's IoThread:
//! - the *reader* receives requests into a large buffer (many per recv), parses them, reads
//!   write payloads straight into aligned buffers and starts one task per request, at once
//!   (as QEMU enters a request's coroutine: it runs in the reader's turn until it must
//!   wait, and one that needs no I/O is done before the next request is parsed);
//! - a *request* task does the I/O on the block node and queues its reply (replies may
//!   complete out of order, as NBD allows);
//! - the *writer* sends everything queued with one writev per round, so a busy connection
//!   costs a few syscalls for many requests. The only request in flight (QD1) sends its
//!   own reply and leaves the writer asleep: at light load a request costs its receive and
//!   one writev, and no task hand-over.
//!
//! Work per connection is bounded: a request counts against its connection's budget
//! ([`MAX_REQUESTS`] requests, [`MAX_BYTES`] bytes of data) from the moment its header is
//! read until its reply has left through the socket, and the reader stops reading while the
//! budget is spent. A client that pipelines huge reads and never reads the replies
//! therefore fills its own socket and then waits, holding at most that budget; it cannot
//! grow the daemon's memory or slow other clients beyond that. Data buffers come from the
//! IoThread's buffer pool.
//!
//! A malformed request closes this connection only. When the client goes away, in-flight
//! requests finish, their replies are dropped, and every buffer is freed with the last task.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use super::export::NbdExport;
use super::handshake::{MetaContexts, Negotiated};
use crate::block::node::block_node::BlockNode;
use crate::block::node::link::Entered;
use crate::buf::Buf;
use crate::export::budget::MemoryBudget;
use crate::nbd_wire::io::{send, try_send, OutChunk, SharedTls, SockReader};
use crate::nbd_wire::proto::*;

/// Requests a connection may have between its header being read and its reply sent.
pub const MAX_REQUESTS: usize = 128;
/// Bytes of data (read replies and write payloads) those requests may hold. A single
/// request larger than what is left still runs when it is the connection's only one.
pub const MAX_BYTES: usize = 64 << 20;
/// Receive coalescing: a client whose requests have been arriving less than this apart
/// (on average, per request) is pipelining.
const COALESCE_GAP_NS: u64 = 8_000;
/// How long the reader waits before receiving from a pipelining client.
const COALESCE_WAIT_NS: u64 = 8_000;

/// Adaptive receive coalescing. A loop that polls picks every request up the moment it
/// arrives, so a pipelining client's requests come one per receive and their replies one
/// per send: two syscalls per request, which is what a request costs here. When requests
/// have been arriving close together, the reader waits a few µs (a loop timer: the loop
/// goes on serving everything else) before receiving, so several come at once and their
/// replies leave in one send. A client that sends one request at a time (QD1: ~30 µs apart)
/// is never delayed.
struct Coalescer {
    /// When the last receive began, and requests parsed since.
    last_ns: u64,
    since: u32,
    /// Moving average (1/4) of the time per request between receives.
    gap_ns: u64,
}

impl Coalescer {
    fn new() -> Self {
        Self {
            last_ns: stord_aio::sys::now_ns(),
            since: 0,
            gap_ns: u64::MAX / 4,
        }
    }

    /// The reader is about to receive: how long to wait first.
    fn before_receive(&mut self) -> u64 {
        let now = stord_aio::sys::now_ns();
        if self.since > 0 {
            let sample = (now - self.last_ns) / u64::from(self.since);
            self.gap_ns = self.gap_ns - self.gap_ns / 4 + sample / 4;
        }
        self.since = 0;
        self.last_ns = now;
        if self.gap_ns < COALESCE_GAP_NS {
            COALESCE_WAIT_NS
        } else {
            0
        }
    }
}

/// Extents per BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 128;

struct Conn {
    fd: OwnedFd,
    /// The TLS session, if the client started one.
    tls: Option<SharedTls>,
    export: Arc<NbdExport>,
    structured: bool,
    meta: MetaContexts,
    out: RefCell<Vec<OutChunk>>,
    /// Requests and bytes whose replies are in `out`.
    out_held: Cell<(usize, usize)>,
    /// Bytes at the front of `out` already sent (by [`Conn::send_now`]), for the writer to
    /// skip.
    out_sent: Cell<usize>,
    /// The reader holds the next request already (a pipelining client): replies go through
    /// the writer, to leave together.
    more_coming: Cell<bool>,
    writer_waker: RefCell<Option<Waker>>,
    reader_waker: RefCell<Option<Waker>>,
    /// Requests admitted whose reply has not left yet, and the bytes they hold.
    held: Cell<(usize, usize)>,
    /// The server's budget those bytes also count against (shared by its connections).
    budget: Arc<MemoryBudget>,
    /// The reader has stopped: no more requests will come.
    reader_done: Cell<bool>,
    /// Sending failed: replies are dropped.
    broken: Cell<bool>,
    /// Reply batches sent (x-stats `nbd.sends`).
    sends: std::sync::Arc<stord_aio::Counter>,
}

impl Drop for Conn {
    /// Whatever its requests still held goes back to the export's and the server's
    /// budgets.
    fn drop(&mut self) {
        let bytes = self.held.get().1;
        self.export.budget.give_back(bytes);
        self.budget.give_back(bytes);
    }
}

impl Conn {
    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn wake_writer(&self) {
        if let Some(w) = self.writer_waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Whether a request of `cost` bytes may start now.
    fn admits(&self, cost: usize) -> bool {
        let (n, bytes) = self.held.get();
        n < MAX_REQUESTS && (n == 0 || bytes + cost <= MAX_BYTES)
    }

    fn admit(&self, cost: usize) {
        let (n, bytes) = self.held.get();
        self.held.set((n + 1, bytes + cost));
    }

    /// Gives back the budget of `n` requests holding `bytes` (their replies left or were
    /// dropped) and lets the reader go on.
    fn release(&self, n: usize, bytes: usize) {
        let (hn, hb) = self.held.get();
        self.held.set((hn - n, hb - bytes));
        self.export.budget.give_back(bytes);
        self.budget.give_back(bytes);
        if let Some(w) = self.reader_waker.borrow_mut().take() {
            w.wake();
        }
        if self.reader_done.get() && hn == n {
            self.wake_writer();
        }
    }

    /// Sending failed: drop every queued reply and stop reading.
    fn break_off(&self) {
        self.broken.set(true);
        self.out.borrow_mut().clear();
        let (n, bytes) = self.out_held.replace((0, 0));
        self.release(n, bytes);
        // Make the reader see the end too.
        crate::sys::shutdown(self.raw());
    }

    /// Queues the reply to `req`: its header `parts` (appended to the pending header
    /// bytes, so consecutive replies share one buffer and no allocation) and its data, if
    /// any. This is the request's one reply: its budget goes back once the reply is sent.
    ///
    /// The connection's only request in flight (QD1) sends its reply at once
    /// ([`send_now`](Self::send_now)); with more in flight, or more read and about to
    /// start, replies that complete in the same turn leave together through the writer, in
    /// one writev.
    fn queue(&self, req: &Request, parts: &[&[u8]], data: Option<Buf>) {
        if self.broken.get() {
            self.release(1, req.cost);
            return;
        }
        let mut out = self.out.borrow_mut();
        let alone = out.is_empty()
            && self.held.get().0 == 1
            && !self.more_coming.get()
            && self.tls.is_none()
            && self.writer_waker.borrow().is_some();
        let bytes = match out.last_mut() {
            Some(OutChunk::Bytes(b)) if b.len() < 4096 => b,
            _ => {
                out.push(OutChunk::Bytes(Vec::with_capacity(512)));
                match out.last_mut() {
                    Some(OutChunk::Bytes(b)) => b,
                    _ => unreachable!("just pushed"),
                }
            }
        };
        for p in parts {
            bytes.extend_from_slice(p);
        }
        if let Some(d) = data {
            out.push(OutChunk::Data(d));
        }
        drop(out);
        let (n, b) = self.out_held.get();
        self.out_held.set((n + 1, b + req.cost));
        if alone {
            self.send_now();
        } else {
            self.wake_writer();
        }
    }

    /// Sends what `out` holds now, from the request's own turn, while the writer is idle:
    /// no trip through the writer task. What the socket does not take is the writer's to
    /// finish.
    fn send_now(&self) {
        // Counted before the write, as the writer counts: a client that has its reply
        // and then reads the counters finds it counted.
        self.sends.add(1);
        let mut out = self.out.borrow_mut();
        match try_send(self.raw(), &mut out) {
            Ok(_) if out.is_empty() => {
                drop(out);
                let (n, bytes) = self.out_held.replace((0, 0));
                self.release(n, bytes);
            }
            Ok(sent) => {
                drop(out);
                self.out_sent.set(sent);
                self.wake_writer();
            }
            Err(_) => {
                drop(out);
                self.break_off();
            }
        }
    }

    fn simple_reply(&self, req: &Request, error: u32, data: Option<Buf>) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        h[4..8].copy_from_slice(&error.to_be_bytes());
        h[8..16].copy_from_slice(&req.handle.to_be_bytes());
        self.queue(req, &[&h], data);
    }

    fn chunk_header(handle: u64, flags: u16, kind: u16, len: u32) -> [u8; 20] {
        let mut h = [0u8; 20];
        h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        h[4..6].copy_from_slice(&flags.to_be_bytes());
        h[6..8].copy_from_slice(&kind.to_be_bytes());
        h[8..16].copy_from_slice(&handle.to_be_bytes());
        h[16..20].copy_from_slice(&len.to_be_bytes());
        h
    }

    fn error_reply(&self, req: &Request, error: u32) {
        if self.structured {
            let h = Self::chunk_header(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6);
            self.queue(req, &[&h, &error.to_be_bytes(), &0u16.to_be_bytes()], None);
        } else {
            self.simple_reply(req, error, None);
        }
    }
}

struct Request {
    flags: u16,
    kind: u16,
    handle: u64,
    offset: u64,
    len: u32,
    /// Bytes of data it holds against the connection's budget.
    cost: usize,
}

impl Request {
    /// Parses a 28-byte request header; None if the magic is wrong.
    fn parse(h: &[u8]) -> Option<Request> {
        let magic = u32::from_be_bytes(h[0..4].try_into().expect("4"));
        let mut req = Request {
            flags: u16::from_be_bytes(h[4..6].try_into().expect("2")),
            kind: u16::from_be_bytes(h[6..8].try_into().expect("2")),
            handle: u64::from_be_bytes(h[8..16].try_into().expect("8")),
            offset: u64::from_be_bytes(h[16..24].try_into().expect("8")),
            len: u32::from_be_bytes(h[24..28].try_into().expect("4")),
            cost: 0,
        };
        // Only data that will really be allocated counts: an oversized READ is refused
        // without a buffer; an oversized WRITE closes the connection.
        if matches!(req.kind, CMD_READ | CMD_WRITE) && req.len <= MAX_PAYLOAD {
            req.cost = req.len as usize;
        }
        (magic == REQUEST_MAGIC).then_some(req)
    }
}

/// Serves one negotiated connection until it ends. Runs on the export's IoThread.
pub async fn serve(fd: OwnedFd, n: Negotiated, budget: Arc<MemoryBudget>) {
    let Negotiated {
        export,
        structured,
        meta,
        pending,
        tls,
        cipher,
    } = n;
    let conn = Rc::new(Conn {
        fd,
        tls,
        export,
        structured,
        meta,
        out: RefCell::default(),
        out_held: Cell::new((0, 0)),
        out_sent: Cell::new(0),
        more_coming: Cell::new(false),
        writer_waker: RefCell::default(),
        reader_waker: RefCell::default(),
        held: Cell::new((0, 0)),
        budget,
        reader_done: Cell::new(false),
        broken: Cell::new(false),
        sends: crate::nbd_wire::io::IoCounters::current().sends,
    });
    let fd_raw = conn.raw();
    conn.export
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(fd_raw);
    if conn
        .export
        .shutting_down
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        // Deleted while this connection was moving to its IoThread.
        crate::sys::shutdown(fd_raw);
    }
    let writer = stord_aio::spawn(write_loop(conn.clone()));
    if let Err(e) = read_loop(&conn, pending, cipher).await {
        use io::ErrorKind::*;
        if !matches!(e.kind(), UnexpectedEof | BrokenPipe | ConnectionReset) {
            log_close(&conn, &e);
        }
    }
    conn.reader_done.set(true);
    conn.wake_writer();
    writer.await;
    // The connection's memory goes back to the system once connections settle.
    crate::sys::release_free_memory_soon();
    // Forget the fd before it is closed (with the last reference to `conn`), so a
    // disconnect from another thread never shuts down a reused fd number.
    conn.export
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|&f| f != fd_raw);
    conn.export.drain.wake();
}

fn log_close(conn: &Conn, e: &io::Error) {
    tracing::info!("nbd export '{}': closing connection: {e}", conn.export.name);
}

async fn write_loop(conn: Rc<Conn>) {
    // The batch being sent; it and `conn.out` swap their (empty) buffers, so a busy
    // connection allocates no list per reply.
    let mut batch = Vec::new();
    loop {
        let held = poll_fn(|cx| {
            let mut out = conn.out.borrow_mut();
            if !out.is_empty() {
                std::mem::swap(&mut *out, &mut batch);
                return Poll::Ready(Some(conn.out_held.replace((0, 0))));
            }
            if conn.reader_done.get() && conn.held.get().0 == 0 {
                return Poll::Ready(None);
            }
            *conn.writer_waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        let Some((n, bytes)) = held else {
            break;
        };
        conn.sends.add(1);
        let from = conn.out_sent.replace(0);
        let sent = !conn.broken.get()
            && send(conn.raw(), conn.tls.as_ref(), &mut batch, from)
                .await
                .is_ok();
        batch.clear();
        conn.release(n, bytes);
        if !sent && !conn.broken.get() {
            conn.break_off();
        }
    }
}

async fn read_loop(conn: &Rc<Conn>, pending: Vec<u8>, cipher: Vec<u8>) -> io::Result<()> {
    let counters = crate::nbd_wire::io::IoCounters::current();
    let requests = counters.requests.clone();
    let mut rd = SockReader::new(conn.raw(), pending).with_counters(counters);
    if let Some(tls) = &conn.tls {
        rd = rd.with_tls(tls.clone(), cipher);
    }
    let mut coalesce = Coalescer::new();
    loop {
        let req = next_request(&mut rd, &mut coalesce).await?;
        if req.kind == CMD_DISC {
            return Ok(());
        }
        if !take_budget(conn, req.cost).await {
            return Ok(());
        }
        conn.admit(req.cost);
        requests.add(1);
        coalesce.since += 1;
        let payload = if req.kind == CMD_WRITE {
            match rd.read_payload(req.len as usize).await {
                Ok(p) => Some(p),
                Err(e) => {
                    conn.release(1, req.cost);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // With another request's header already here, replies that complete now wait
        // for it and leave together through the writer.
        conn.more_coming.set(rd.buffered().len() >= 28);
        stord_aio::spawn_now(request_task(conn.clone(), req, payload));
    }
}

/// Reads the next request header (after the coalescing wait, when nothing is buffered). A
/// bad magic or a write payload over the maximum is an error: the connection closes.
async fn next_request(rd: &mut SockReader, coalesce: &mut Coalescer) -> io::Result<Request> {
    if rd.buffered().is_empty() {
        let wait = coalesce.before_receive();
        if wait > 0 {
            stord_aio::sleep(std::time::Duration::from_nanos(wait)).await;
        }
    }
    rd.ensure(28).await?;
    let Some(req) = Request::parse(rd.consume(28)) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad request magic",
        ));
    };
    if req.kind == CMD_WRITE && req.len > MAX_PAYLOAD {
        // We cannot skip gigabytes safely: close, as the protocol allows.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "write payload over the maximum",
        ));
    }
    Ok(req)
}

/// Back-pressure: waits for budget before a payload is read or the I/O starts, so a client
/// that does not read its replies stops being read. First the connection's own budget,
/// then the export's and the server's, which other connections draw from too (woken when
/// any of them gives bytes back). False when the connection broke meanwhile: nothing is
/// held then.
async fn take_budget(conn: &Conn, cost: usize) -> bool {
    let mut export_taken = false;
    let taken = poll_fn(|cx| {
        if conn.broken.get() {
            return Poll::Ready(false);
        }
        if !conn.admits(cost) {
            *conn.reader_waker.borrow_mut() = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let idle = conn.held.get().0 == 0;
        if !export_taken {
            if conn.export.budget.poll_take(cx, cost, idle).is_pending() {
                return Poll::Pending;
            }
            export_taken = true;
        }
        conn.budget.poll_take(cx, cost, idle).map(|()| true)
    })
    .await;
    if conn.broken.get() || !taken {
        if export_taken {
            conn.export.budget.give_back(cost);
        }
        if taken {
            conn.budget.give_back(cost);
        }
        return false;
    }
    true
}

/// Validation common to all commands: the wire error, if the request is refused.
fn check(conn: &Conn, node: &BlockNode, req: &Request) -> Result<(), u32> {
    let export = &conn.export;
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    let known = matches!(
        req.kind,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_WRITE_ZEROES | CMD_BLOCK_STATUS
    );
    if !known {
        return Err(EINVAL);
    }
    if writes && !export.writable {
        return Err(EPERM);
    }
    if req.kind == CMD_READ && req.len > MAX_PAYLOAD {
        return Err(EOVERFLOW);
    }
    if req.kind == CMD_BLOCK_STATUS && !conn.meta.any() {
        return Err(EINVAL);
    }
    if req.kind != CMD_FLUSH {
        let end = req.offset.checked_add(req.len as u64);
        if end.is_none_or(|e| e > node.size()) {
            return Err(EINVAL);
        }
    }
    Ok(())
}

/// The task that serves `req`. Its future holds only its own command's state: a task's
/// future is copied into its allocation whole, and a read need not carry a write's.
fn request_task(conn: Rc<Conn>, req: Request, payload: Option<Buf>) -> RequestTask {
    match req.kind {
        CMD_READ => Box::pin(async move {
            if let Some(node) = enter(&conn, &req).await {
                read(&conn, &node, &req).await;
            }
        }),
        CMD_BLOCK_STATUS => Box::pin(async move {
            if let Some(node) = enter(&conn, &req).await {
                block_status(&conn, &node, &req).await;
            }
        }),
        _ => Box::pin(async move {
            if let Some(node) = enter(&conn, &req).await {
                modify(&conn, &node, &req, payload).await;
            }
        }),
    }
}

type RequestTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

/// Enters the node the export serves now (the request runs there even if a pivot moves
/// it) and checks the request against it; None when it was refused (the error reply is
/// queued).
async fn enter<'a>(conn: &'a Conn, req: &Request) -> Option<Entered<'a>> {
    let node = conn.export.link.enter().await;
    match check(conn, &node, req) {
        Ok(()) => Some(node),
        Err(e) => {
            conn.error_reply(req, e);
            None
        }
    }
}

async fn read(conn: &Conn, node: &BlockNode, req: &Request) {
    if conn.structured
        && req.flags & CMD_FLAG_DF == 0
        && req.len > 0
        && read_hole(conn, node, req).await
    {
        return;
    }
    let (r, buf) = node
        .read(req.offset, crate::buf::request_buf(req.len as usize))
        .await;
    match r {
        Ok(()) if conn.structured => {
            let h = Conn::chunk_header(
                req.handle,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                8 + req.len,
            );
            conn.queue(req, &[&h, &req.offset.to_be_bytes()], Some(buf));
        }
        Ok(()) => conn.simple_reply(req, 0, Some(buf)),
        Err(e) => conn.error_reply(req, wire_errno(&e)),
    }
}

/// The commands that change the node (write, write-zeroes, trim) and flush.
async fn modify(conn: &Conn, node: &BlockNode, req: &Request, payload: Option<Buf>) {
    let fua = req.flags & CMD_FLAG_FUA != 0 || conn.export.writethrough;
    let result = match req.kind {
        CMD_WRITE => {
            let buf = payload.expect("write payload");
            node.write(req.offset, buf, fua).await.0
        }
        CMD_FLUSH => node.flush().await,
        CMD_TRIM => {
            let r = node.discard(req.offset, req.len as u64).await;
            match r {
                Ok(()) if fua => node.flush().await,
                other => other,
            }
        }
        CMD_WRITE_ZEROES => {
            let may_unmap = req.flags & CMD_FLAG_NO_HOLE == 0;
            let r = node
                .write_zeroes(req.offset, req.len as u64, may_unmap)
                .await;
            match r {
                Ok(()) if fua => node.flush().await,
                other => other,
            }
        }
        _ => unreachable!("checked on entry"),
    };
    match result {
        Ok(()) => conn.simple_reply(req, 0, None),
        Err(e) => conn.error_reply(req, wire_errno(&e)),
    }
}

/// A sparse read (structured replies, DF not set): when the whole range reads as zero,
/// answers with one OFFSET_HOLE chunk instead of the data, as qemu's server does. True if
/// it replied. Block status is cheap here (the null device knows; a file remembers its last
/// extent), and skipped where it is not; a range that is only partly zero is read and sent
/// as data.
async fn read_hole(conn: &Conn, node: &BlockNode, req: &Request) -> bool {
    // Where asking costs a round trip (an nbd or rbd node), reading the zeroes is cheaper.
    if node.driver().block_status_costly() {
        return false;
    }
    let len = u64::from(req.len);
    let start = stord_aio::sys::now_ns();
    match node.block_status(req.offset, len).await {
        Ok(st) if st.zero && st.len >= len => {
            // Answered without reading, still a read the node served.
            node.stats
                .done(crate::block::node::stats::Op::Read, start, len, true);
            let h = Conn::chunk_header(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 12);
            conn.queue(
                req,
                &[&h, &req.offset.to_be_bytes(), &req.len.to_be_bytes()],
                None,
            );
            true
        }
        _ => false,
    }
}

async fn block_status(conn: &Conn, node: &BlockNode, req: &Request) {
    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
    let mut chunks: Vec<Vec<u8>> = Vec::new();
    for (id, _) in conn.meta.selected(&conn.export) {
        let extents = extents(req, one, |off, len| async move {
            match id {
                META_BASE_ALLOCATION_ID => {
                    let st = node.block_status(off, len).await?;
                    let flags = (if st.allocated { 0 } else { STATE_HOLE })
                        | (if st.zero { STATE_ZERO } else { 0 });
                    Ok((st.len, flags))
                }
                META_ALLOCATION_DEPTH_ID => node.allocation_depth(off, len).await,
                _ => {
                    let b = &conn.export.bitmaps[(id - META_DIRTY_BITMAP_FIRST_ID) as usize];
                    let (len, dirty) = b.extent(off, len);
                    Ok((len, if dirty { STATE_DIRTY } else { 0 }))
                }
            }
        })
        .await;
        let extents = match extents {
            Ok(e) => e,
            Err(e) => return conn.error_reply(req, wire_errno(&e)),
        };
        let mut payload = id.to_be_bytes().to_vec();
        for (len, flags) in &extents {
            payload.extend_from_slice(&len.to_be_bytes());
            payload.extend_from_slice(&flags.to_be_bytes());
        }
        chunks.push(payload);
    }
    let last = chunks.len() - 1;
    let headers: Vec<[u8; 20]> = chunks
        .iter()
        .enumerate()
        .map(|(i, payload)| {
            let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
            Conn::chunk_header(
                req.handle,
                flags,
                REPLY_TYPE_BLOCK_STATUS,
                payload.len() as u32,
            )
        })
        .collect();
    // All chunks in one `queue`: it is the request's one reply (each call gives back the
    // request's budget once; a call per chunk gave it back twice).
    let parts: Vec<&[u8]> = headers
        .iter()
        .zip(&chunks)
        .flat_map(|(h, p)| [&h[..], &p[..]])
        .collect();
    conn.queue(req, &parts, None);
}

/// The extents of one metadata context over a request's range: `status(offset, len)` gives
/// the first extent's length and flags; neighbours with equal flags merge. An error before
/// the first extent fails the request; a later one ends the list.
async fn extents<F, Fut>(req: &Request, one: bool, status: F) -> io::Result<Vec<(u32, u32)>>
where
    F: Fn(u64, u64) -> Fut,
    Fut: std::future::Future<Output = io::Result<(u64, u32)>>,
{
    let end = req.offset + req.len as u64;
    let mut extents: Vec<(u32, u32)> = Vec::new();
    let mut off = req.offset;
    while off < end && extents.len() < MAX_EXTENTS {
        match status(off, end - off).await {
            Ok((len, flags)) => {
                match extents.last_mut() {
                    Some((l, f)) if *f == flags => *l += len as u32,
                    _ => extents.push((len as u32, flags)),
                }
                off += len;
            }
            Err(e) if extents.is_empty() => return Err(e),
            Err(_) => break,
        }
        if one {
            break;
        }
    }
    if one {
        extents.truncate(1);
    }
    Ok(extents)
}
