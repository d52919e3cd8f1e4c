//! Buffered socket input and gathered output for one NBD connection, on stord-aio ops.
//!
//! After STARTTLS the same reader and sender carry a [`TlsSession`]: ciphertext is
//! received as before and decrypted into the reader's buffer; replies are encrypted as one
//! batch and the records written straight to the socket.

use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use stord_aio::{op, Interest, IoBuf, Slice};

use crate::buf::{request_buf, Buf};
use crate::tls::session::TlsSession;

/// A connection's TLS session, shared by its reader and its writers (the server's
/// connection keeps both on one thread; the NBD client's requests send from any loop).
#[derive(Clone)]
pub struct SharedTls(Arc<Mutex<Box<dyn TlsSession>>>);

impl SharedTls {
    pub fn new(sess: Box<dyn TlsSession>) -> Self {
        SharedTls(Arc::new(Mutex::new(sess)))
    }

    pub fn lock(&self) -> MutexGuard<'_, Box<dyn TlsSession>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

const READ_BUF: usize = 256 << 10;

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed")
}

/// What one loop thread's NBD connections count (x-stats `nbd.*`): receives, receives
/// that found nothing, and sends, to compare with requests.
pub struct IoCounters {
    pub requests: std::sync::Arc<stord_aio::Counter>,
    pub recvs: std::sync::Arc<stord_aio::Counter>,
    pub recv_empty: std::sync::Arc<stord_aio::Counter>,
    pub sends: std::sync::Arc<stord_aio::Counter>,
}

impl IoCounters {
    /// The current loop's counters.
    pub fn current() -> Self {
        stord_aio::with_current_context(|c| IoCounters {
            requests: c.counter("nbd.requests"),
            recvs: c.counter("nbd.recvs"),
            recv_empty: c.counter("nbd.recvs-empty"),
            sends: c.counter("nbd.sends"),
        })
        .expect("a connection runs on a loop")
    }
}

/// Reads from a socket in bulk and hands out exact-sized pieces.
pub struct SockReader {
    fd: RawFd,
    /// The peer is our storage (a network block client's server), not a client: its
    /// waits teach the loop's storage poll window (`Op::on_storage`).
    storage: bool,
    counters: Option<IoCounters>,
    buf: Option<Vec<u8>>,
    start: usize,
    end: usize,
    tls: Option<TlsRx>,
}

/// The receiving side of a TLS session: ciphertext received but not yet taken.
struct TlsRx {
    sess: SharedTls,
    cbuf: Option<Vec<u8>>,
    start: usize,
    end: usize,
}

/// Ciphertext received per recv: a few full records.
const TLS_READ_BUF: usize = 64 << 10;

fn tls_failed(e: crate::tls::error::TlsError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl TlsRx {
    /// Decrypted bytes into `dst` (non-empty), receiving ciphertext as needed.
    async fn read_plain(
        &mut self,
        fd: RawFd,
        storage: bool,
        counters: &Option<IoCounters>,
        dst: &mut [u8],
    ) -> io::Result<usize> {
        loop {
            match self.sess.lock().read_plain(dst) {
                Ok(0) => return Err(eof()),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            self.feed(fd, storage, counters).await?;
        }
    }

    /// Hands the session more ciphertext (receiving it if none is buffered) and lets it
    /// process what it got.
    async fn feed(
        &mut self,
        fd: RawFd,
        storage: bool,
        counters: &Option<IoCounters>,
    ) -> io::Result<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            let buf = self.cbuf.take().expect("buffer");
            let cap = buf.len();
            let (r, slice) = op::recv(fd, Slice::new(buf, 0, cap), 0)
                .on_storage_if(storage)
                .await;
            self.cbuf = Some(slice.into_inner());
            if let Some(c) = counters {
                c.recvs.add(1);
            }
            match r {
                Ok(0) => return Err(eof()),
                Ok(n) => self.end = n,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if let Some(c) = counters {
                        c.recv_empty.add(1);
                    }
                    op::poll_add(fd, Interest::READABLE)
                        .on_storage_if(storage)
                        .await?;
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        let mut sess = self.sess.lock();
        let mut have = &self.cbuf.as_ref().expect("buffer")[self.start..self.end];
        let n = sess.read_tls(&mut have)?;
        self.start += n;
        sess.process_new_packets().map_err(tls_failed)
    }
}

impl SockReader {
    /// A reader that first returns `pending` (bytes already read by someone else).
    pub fn new(fd: RawFd, pending: Vec<u8>) -> Self {
        let mut buf = vec![0u8; READ_BUF.max(pending.len())];
        buf[..pending.len()].copy_from_slice(&pending);
        Self {
            fd,
            storage: false,
            counters: None,
            buf: Some(buf),
            start: 0,
            end: pending.len(),
            tls: None,
        }
    }

    /// A reader of replies from our storage (see the `storage` field).
    pub fn on_storage(mut self) -> Self {
        self.storage = true;
        self
    }

    /// Switches to TLS: from now on what arrives is ciphertext for `sess`, starting with
    /// whatever is buffered.
    pub fn start_tls(&mut self, sess: SharedTls) {
        let pending = self.buffered().to_vec();
        self.start = 0;
        self.end = 0;
        self.set_tls(sess, pending);
    }

    /// A reader for a connection already in TLS: `cipher` is ciphertext received but not
    /// yet handed to `sess`.
    pub fn with_tls(mut self, sess: SharedTls, cipher: Vec<u8>) -> Self {
        self.set_tls(sess, cipher);
        self
    }

    fn set_tls(&mut self, sess: SharedTls, cipher: Vec<u8>) {
        let mut cbuf = vec![0u8; TLS_READ_BUF.max(cipher.len())];
        cbuf[..cipher.len()].copy_from_slice(&cipher);
        self.tls = Some(TlsRx {
            sess,
            cbuf: Some(cbuf),
            start: 0,
            end: cipher.len(),
        });
    }

    /// Runs the TLS handshake to its end (after `start_tls`).
    pub async fn tls_handshake(&mut self) -> io::Result<()> {
        let rx = self.tls.as_mut().expect("start_tls first");
        loop {
            flush_tls(self.fd, &rx.sess).await?;
            if !rx.sess.lock().is_handshaking() {
                return Ok(());
            }
            if let Err(e) = rx.feed(self.fd, self.storage, &self.counters).await {
                // Tell the client why (the session queued an alert), if it still listens.
                let _ = flush_tls(self.fd, &rx.sess).await;
                return Err(e);
            }
        }
    }

    /// Gives back the unconsumed bytes: decrypted bytes, and ciphertext not yet decrypted.
    pub fn into_parts(self) -> (Vec<u8>, Vec<u8>) {
        let plain = self.buffered().to_vec();
        let cipher = match &self.tls {
            Some(rx) => rx.cbuf.as_ref().expect("buffer")[rx.start..rx.end].to_vec(),
            None => Vec::new(),
        };
        (plain, cipher)
    }

    /// Counts receives in `c`.
    pub fn with_counters(mut self, c: IoCounters) -> Self {
        self.counters = Some(c);
        self
    }

    /// Bytes read but not consumed.
    pub fn buffered(&self) -> &[u8] {
        &self.buf.as_ref().expect("buffer")[self.start..self.end]
    }

    /// Reads more from the socket (at least one byte, or an error at end of stream).
    async fn fill(&mut self) -> io::Result<()> {
        let mut buf = self.buf.take().expect("buffer");
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == buf.len() {
            buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let cap = buf.len();
        if let Some(rx) = &mut self.tls {
            let r = rx
                .read_plain(self.fd, self.storage, &self.counters, &mut buf[self.end..])
                .await;
            self.buf = Some(buf);
            self.end += r?;
            return Ok(());
        }
        let (r, slice) = op::recv(self.fd, Slice::new(buf, self.end, cap), 0)
            .on_storage_if(self.storage)
            .await;
        self.buf = Some(slice.into_inner());
        if let Some(c) = &self.counters {
            c.recvs.add(1);
        }
        if matches!(&r, Err(e) if e.raw_os_error() == Some(libc::EAGAIN)) {
            if let Some(c) = &self.counters {
                c.recv_empty.add(1);
            }
            op::poll_add(self.fd, Interest::READABLE)
                .on_storage_if(self.storage)
                .await?;
            return Ok(());
        }
        match r {
            Ok(0) => Err(eof()),
            Ok(n) => {
                self.end += n;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Waits until at least `n` bytes are buffered (n <= the buffer's size).
    pub async fn ensure(&mut self, n: usize) -> io::Result<()> {
        while self.end - self.start < n {
            self.fill().await?;
        }
        Ok(())
    }

    /// Consumes `n` buffered bytes (after `ensure(n)`).
    pub fn consume(&mut self, n: usize) -> &[u8] {
        let s = self.start;
        self.start += n;
        &self.buf.as_ref().expect("buffer")[s..s + n]
    }

    /// Reads exactly `n` bytes into a new Vec.
    pub async fn read_vec(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.start == self.end {
                self.fill().await?;
            }
            let take = (n - out.len()).min(self.end - self.start);
            out.extend_from_slice(self.consume(take));
        }
        Ok(out)
    }

    /// Reads exactly `n` bytes into an aligned request buffer: what is buffered is copied,
    /// the rest is received straight into the buffer.
    pub async fn read_payload(&mut self, n: usize) -> io::Result<Buf> {
        let (r, buf) = self.read_into(request_buf(n), 0, n).await;
        r.map(|()| buf)
    }

    /// Fills `buf[start..end]` from the stream: what is buffered is copied, the rest is
    /// received straight into `buf`, which comes back in every case.
    pub async fn read_into(
        &mut self,
        mut buf: Buf,
        start: usize,
        end: usize,
    ) -> (io::Result<()>, Buf) {
        let have = (self.end - self.start).min(end - start);
        buf[start..start + have].copy_from_slice(self.consume(have));
        let mut got = start + have;
        if let Some(rx) = &mut self.tls {
            while got < end {
                match rx
                    .read_plain(self.fd, self.storage, &self.counters, &mut buf[got..end])
                    .await
                {
                    Ok(k) => got += k,
                    Err(e) => return (Err(e), buf),
                }
            }
            return (Ok(()), buf);
        }
        while got < end {
            let (r, slice) = op::recv(self.fd, Slice::new(buf, got, end), 0)
                .on_storage_if(self.storage)
                .await;
            buf = slice.into_inner();
            match r {
                Ok(0) => return (Err(eof()), buf),
                Ok(k) => got += k,
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if let Err(e) = op::poll_add(self.fd, Interest::READABLE)
                        .on_storage_if(self.storage)
                        .await
                    {
                        return (Err(e), buf);
                    }
                }
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    /// Skips `n` bytes.
    pub async fn discard(&mut self, mut n: usize) -> io::Result<()> {
        while n > 0 {
            if self.start == self.end {
                self.fill().await?;
            }
            let take = n.min(self.end - self.start);
            self.consume(take);
            n -= take;
        }
        Ok(())
    }
}

/// A piece of output: small header bytes or a data buffer.
pub enum OutChunk {
    /// Bytes built here (headers, small replies).
    Bytes(Vec<u8>),
    /// A request's data buffer.
    Data(Buf),
}

impl OutChunk {
    fn len(&self) -> usize {
        match self {
            OutChunk::Bytes(v) => v.len(),
            OutChunk::Data(b) => b.len(),
        }
    }
}

// SAFETY: both variants are heap buffers whose bytes do not move with the enum and are
// fully initialised; we only forward to their own IoBuf implementations.
unsafe impl IoBuf for OutChunk {
    fn stable_ptr(&self) -> *const u8 {
        match self {
            OutChunk::Bytes(v) => v.stable_ptr(),
            OutChunk::Data(b) => b.stable_ptr(),
        }
    }
    fn bytes_len(&self) -> usize {
        self.len()
    }
}

impl std::ops::Deref for OutChunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            OutChunk::Bytes(v) => v,
            OutChunk::Data(b) => b,
        }
    }
}

/// Sends `chunks` in order, through the TLS session if there is one, else as they are
/// (the first `sent` bytes of them went out already: see [`try_send`]; only without TLS);
/// `chunks` is left empty, with its capacity (a connection's writer reuses it).
pub async fn send(
    fd: RawFd,
    tls: Option<&SharedTls>,
    chunks: &mut Vec<OutChunk>,
    sent: usize,
) -> io::Result<()> {
    let Some(tls) = tls else {
        if sent > 0 {
            return send_rest(fd, std::mem::take(chunks), sent).await;
        }
        return send_all(fd, chunks).await;
    };
    debug_assert_eq!(sent, 0, "a TLS session's records are written whole");
    {
        let views: Vec<io::IoSlice<'_>> = chunks.iter().map(|c| io::IoSlice::new(c)).collect();
        let written = tls.lock().write_plain(&views);
        drop(views);
        chunks.clear();
        written?;
    }
    flush_tls(fd, tls).await
}

/// A non-blocking socket as `io::Write`, for the session to write its records into.
struct FdWriter(RawFd);

impl io::Write for FdWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        stord_aio::sys::writev_now(self.0, &[buf])
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let views: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
        stord_aio::sys::writev_now(self.0, &views)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes the session's waiting records into the non-blocking socket `fd` now: `Ok(true)`
/// when none is left, `Ok(false)` when the socket is full.
pub fn write_records(s: &mut dyn TlsSession, fd: RawFd) -> io::Result<bool> {
    while s.wants_write() {
        match s.write_tls(&mut FdWriter(fd)) {
            Ok(0) => return Err(io::Error::from_raw_os_error(libc::EPIPE)),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Sends every record the session has waiting, waiting for room in the socket as needed.
pub async fn flush_tls(fd: RawFd, tls: &SharedTls) -> io::Result<()> {
    while !write_records(&mut **tls.lock(), fd)? {
        op::poll_add(fd, Interest::WRITABLE).await?;
    }
    Ok(())
}

/// One non-blocking writev of `chunks`, now: the bytes it took (0 when the socket is
/// full). When it took them all, `chunks` is left empty (its capacity kept); else it is
/// left as it was, for [`send_rest`] to finish.
pub fn try_send(fd: RawFd, chunks: &mut Vec<OutChunk>) -> io::Result<usize> {
    chunks.retain(|c| !c.is_empty());
    let sent = match stord_aio::sys::writev_iter(fd, chunks.iter().map(|c| &c[..])) {
        Ok(n) => n,
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            0
        }
        Err(e) => return Err(e),
    };
    if sent == chunks.iter().map(|c| c.len()).sum::<usize>() {
        chunks.clear();
    }
    Ok(sent)
}

/// Sends every chunk, in order, with as few writev calls as the socket allows, and leaves
/// `chunks` empty (its capacity kept for the next batch).
///
/// The first attempt is a direct non-blocking writev ([`try_send`]): a socket with room in
/// its send buffer (the common case) takes the whole batch at once, with no SQE, no CQE,
/// no extra loop iteration and no allocation. Whatever does not fit goes through the ring.
pub async fn send_all(fd: RawFd, chunks: &mut Vec<OutChunk>) -> io::Result<()> {
    let sent = match try_send(fd, chunks) {
        Ok(n) => n,
        Err(e) => {
            chunks.clear();
            return Err(e);
        }
    };
    if chunks.is_empty() {
        return Ok(());
    }
    send_rest(fd, std::mem::take(chunks), sent).await
}

/// Sends what is left of `chunks` once their first `sent_now` bytes went out, through the
/// ring, waiting for room in the socket as needed.
pub async fn send_rest(fd: RawFd, chunks: Vec<OutChunk>, mut sent_now: usize) -> io::Result<()> {
    let mut slices: Vec<Slice<OutChunk>> = Vec::new();
    for c in chunks {
        let n = c.len();
        if sent_now >= n {
            sent_now -= n;
            continue;
        }
        slices.push(Slice::new(c, sent_now, n));
        sent_now = 0;
    }
    while !slices.is_empty() {
        // At most IOV_MAX (1024) iovecs per call.
        let rest = if slices.len() > 1024 {
            slices.split_off(1024)
        } else {
            Vec::new()
        };
        let (r, mut sent) = op::writev(fd, slices, op::CURRENT_POSITION).await;
        let mut n = match r {
            // A non-blocking socket with a full send buffer: wait until it drains.
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                op::poll_add(fd, Interest::WRITABLE).await?;
                sent.extend(rest);
                slices = sent;
                continue;
            }
            r => r?,
        };
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EPIPE));
        }
        // Drop what went out; trim the first partly sent slice.
        let mut keep = Vec::with_capacity(sent.len() + rest.len());
        for s in sent.drain(..) {
            let len = s.bytes_len();
            if n >= len {
                n -= len;
                continue;
            }
            let start = s.start() + n;
            n = 0;
            let inner = s.into_inner();
            let end = inner.len();
            keep.push(Slice::new(inner, start, end));
        }
        keep.extend(rest);
        slices = keep;
    }
    Ok(())
}
