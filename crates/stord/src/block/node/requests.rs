//! A node's requests: the checks (range, writable), the hooks jobs run around them, the
//! dirty bitmaps and counters, `detect-zeroes`, then the driver.

use std::future::Future;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use stord_aio::sys::now_ns;

use super::block_node::{BlockNode, BlockStatus};
use super::future::BoxFut;
use super::options::DetectZeroes;
use super::stats::Op;
use super::{dirty_bitmap, hook};
use crate::buf::{is_zero, request_buf, Buf};
use crate::iov::IoVec;

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

impl BlockNode {
    /// The write-zeroes an all-zero write of `len` bytes becomes under `detect-zeroes`, if
    /// any: its `may_unmap`.
    fn zero_write(&self, data_is_zero: impl FnOnce() -> bool) -> Option<bool> {
        match self.detect_zeroes {
            DetectZeroes::Off => None,
            mode => data_is_zero().then_some(mode == DetectZeroes::Unmap && self.unmap),
        }
    }

    /// Current size.
    pub fn size(&self) -> u64 {
        self.driver.size()
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(einval("request beyond the end of the node")),
        }
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.is_read_only() || self.is_inactive() {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        } else {
            Ok(())
        }
    }

    /// Whether `[offset, offset + len)` may be written now: the node is writable and the
    /// range inside it (the hooks run after, where there are any).
    fn check_write(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        self.note_write(offset, len);
        Ok(())
    }

    /// A write of `[offset, offset + len)` is about to reach the node (or its driver,
    /// from a format above that writes to it directly): past the write threshold, the
    /// threshold is announced and cleared, once (QEMU's
    /// bdrv_write_threshold_check_write).
    pub fn note_write(&self, offset: u64, len: u64) {
        let threshold = self.write_threshold.load(Relaxed);
        let end = offset.saturating_add(len);
        if threshold == 0 || end <= threshold {
            return;
        }
        if self
            .write_threshold
            .compare_exchange(threshold, 0, Relaxed, Relaxed)
            .is_ok()
        {
            if let Some(e) = self.events.get() {
                e.emit(
                    "BLOCK_WRITE_THRESHOLD",
                    serde_json::json!({
                        "node-name": self.name,
                        "amount-exceeded": end - threshold,
                        "write-threshold": threshold,
                    }),
                );
            }
        }
    }

    /// Runs `read` with what `hooks` hold for a read of `[offset, offset + len)` (the
    /// request starts only once they hold it). Boxed, as every hooked path here: a
    /// request's future is copied into its task whole, and only the requests that meet a
    /// hook (while a job runs) should carry the hooks' state.
    fn read_hooked<'a, F: Future + 'a>(
        &'a self,
        hooks: Vec<Arc<dyn hook::NodeHook>>,
        (offset, len): (u64, u64),
        read: impl FnOnce() -> F + 'a,
    ) -> BoxFut<'a, F::Output> {
        Box::pin(async move {
            let mut held = Vec::new();
            for h in &hooks {
                held.extend(h.before_read(offset, len).await);
            }
            let r = read().await;
            drop(held);
            r
        })
    }

    /// A write-like request (`run`, handed its payload) between the hooks'
    /// [`before_write`](hook::NodeHook::before_write) and
    /// [`after_write`](hook::NodeHook::after_write): `written` says what it wrote, and
    /// whether a success changed the range. A hook's error fails it as `op`, the payload
    /// handed back unwritten. Boxed, as [`read_hooked`](Self::read_hooked).
    fn write_hooked<'a, P: 'a, F>(
        &'a self,
        hooks: Vec<Arc<dyn hook::NodeHook>>,
        (op, offset, len): (Op, u64, u64),
        payload: P,
        run: impl FnOnce(P) -> F + 'a,
        written: fn(&P) -> (hook::Written<'_>, bool),
    ) -> BoxFut<'a, (io::Result<()>, P)>
    where
        F: Future<Output = (io::Result<()>, P)> + 'a,
    {
        Box::pin(async move {
            let held = match hook::before_write(&hooks, offset, len).await {
                Ok(h) => h,
                Err(e) => {
                    self.stats.refused(op, &e);
                    return (Err(e), payload);
                }
            };
            let (r, payload) = run(payload).await;
            let (what, changes) = written(&payload);
            let ok = r.is_ok() && changes;
            hook::after_write(&hooks, &held, (offset, len), ok, what).await;
            drop(held);
            (r, payload)
        })
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub async fn read(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let start = now_ns();
        let len = buf.len() as u64;
        if let Err(e) = self.check_range(offset, len) {
            self.stats.refused(Op::Read, &e);
            return (Err(e), buf);
        }
        let (r, buf) = match self.hooks.current() {
            None => self.driver.read(offset, buf).await,
            Some(hooks) => {
                let read = || self.driver.read(offset, buf);
                self.read_hooked(hooks, (offset, len), read).await
            }
        };
        self.stats.done(Op::Read, start, len, r.is_ok());
        (r, buf)
    }

    /// Writes `buf` at `offset`.
    pub async fn write(&self, offset: u64, buf: Buf, fua: bool) -> (io::Result<()>, Buf) {
        self.write_as(offset, buf, fua, false).await
    }

    /// Writes `buf` at `offset` compressed (QEMU's BDRV_REQ_WRITE_COMPRESSED: see
    /// [`BlockDriver::write_compressed`](super::block_node::BlockDriver::write_compressed)).
    /// As in QEMU, `detect-zeroes` turns zeroes into a zero write first.
    pub async fn write_compressed(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        self.write_as(offset, buf, false, true).await
    }

    /// [`write`](Self::write), or with `compressed` [`write_compressed`](Self::write_compressed).
    async fn write_as(
        &self,
        offset: u64,
        buf: Buf,
        fua: bool,
        compressed: bool,
    ) -> (io::Result<()>, Buf) {
        let start = now_ns();
        let len = buf.len() as u64;
        if let Err(e) = self.check_write(offset, len) {
            self.stats.refused(Op::Write, &e);
            return (Err(e), buf);
        }
        let run = |buf: Buf| async move {
            let (r, buf) = match self.zero_write(|| is_zero(&buf)) {
                Some(may_unmap) => (self.zeroes_then_fua(offset, len, may_unmap, fua).await, buf),
                None if compressed => self.driver.write_compressed(offset, buf).await,
                None => self.driver.write(offset, buf, fua).await,
            };
            self.wrote(start, offset, len, &r);
            (r, buf)
        };
        match self.hooks.current() {
            None => run(buf).await,
            Some(hooks) => {
                let what: fn(&Buf) -> (hook::Written<'_>, bool) =
                    |b| (hook::Written::Data(b), true);
                let span = (Op::Write, offset, len);
                self.write_hooked(hooks, span, buf, run, what).await
            }
        }
    }

    /// Reads `iov.len()` bytes at `offset` into `iov`.
    pub async fn readv(&self, offset: u64, iov: IoVec) -> (io::Result<()>, IoVec) {
        let start = now_ns();
        let len = iov.len() as u64;
        if let Err(e) = self.check_range(offset, len) {
            self.stats.refused(Op::Read, &e);
            return (Err(e), iov);
        }
        let (r, iov) = match self.hooks.current() {
            None => self.driver.readv(offset, iov).await,
            Some(hooks) => {
                let read = || self.driver.readv(offset, iov);
                self.read_hooked(hooks, (offset, len), read).await
            }
        };
        self.stats.done(Op::Read, start, len, r.is_ok());
        (r, iov)
    }

    /// Writes `iov` at `offset`.
    pub async fn writev(&self, offset: u64, iov: IoVec, fua: bool) -> (io::Result<()>, IoVec) {
        let start = now_ns();
        let len = iov.len() as u64;
        if let Err(e) = self.check_write(offset, len) {
            self.stats.refused(Op::Write, &e);
            return (Err(e), iov);
        }
        let run = |iov: IoVec| async move {
            let zero = self.zero_write(|| {
                let mut b = request_buf(iov.len());
                iov.copy_out(0, &mut b);
                is_zero(&b)
            });
            let (r, iov) = match zero {
                Some(may_unmap) => (self.zeroes_then_fua(offset, len, may_unmap, fua).await, iov),
                None => self.driver.writev(offset, iov, fua).await,
            };
            self.wrote(start, offset, len, &r);
            (r, iov)
        };
        match self.hooks.current() {
            None => run(iov).await,
            Some(hooks) => {
                let what: fn(&IoVec) -> (hook::Written<'_>, bool) =
                    |v| (hook::Written::Iov(v), true);
                let span = (Op::Write, offset, len);
                self.write_hooked(hooks, span, iov, run, what).await
            }
        }
    }

    /// Counts a request a format above sent straight to this node's driver (qcow2's data
    /// and metadata I/O skips the node's checks), as the node's own.
    pub fn count_direct(&self, op: Op, start: u64, end: u64, len: u64, ok: bool) {
        if ok && op == Op::Write {
            self.stats.wrote_up_to(end);
        }
        self.stats.done(op, start, len, ok);
    }

    /// After a write of any kind (data or zeroes): the bitmaps and the counters.
    fn wrote(&self, start: u64, offset: u64, len: u64, r: &io::Result<()>) {
        self.mark_dirty(offset, len);
        if r.is_ok() {
            self.stats.wrote_up_to(offset + len);
        }
        self.stats.done(Op::Write, start, len, r.is_ok());
    }

    /// A write turned into write-zeroes by `detect-zeroes`, durable if it was FUA.
    async fn zeroes_then_fua(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
        fua: bool,
    ) -> io::Result<()> {
        self.driver.write_zeroes(offset, len, may_unmap).await?;
        if fua {
            self.driver.flush().await?;
        }
        Ok(())
    }

    /// Flushes.
    pub async fn flush(&self) -> io::Result<()> {
        let start = now_ns();
        let r = self.driver.flush().await;
        self.stats.done(Op::Flush, start, 0, r.is_ok());
        r
    }

    /// Discards a range.
    pub async fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let start = now_ns();
        if let Err(e) = self.check_write(offset, len) {
            self.stats.refused(Op::Unmap, &e);
            return Err(e);
        }
        let run = |unmap: bool| async move {
            let r = if unmap {
                let r = self.driver.discard(offset, len).await;
                self.mark_dirty_as(offset, len, true);
                r
            } else {
                Ok(())
            };
            self.stats.done(Op::Unmap, start, len, r.is_ok());
            (r, unmap)
        };
        // Without `unmap` a discard changes nothing, and the hooks hear so.
        match self.hooks.current() {
            None => run(self.unmap).await.0,
            Some(hooks) => {
                let what = |unmap: &bool| (hook::Written::Discard, *unmap);
                let span = (Op::Unmap, offset, len);
                self.write_hooked(hooks, span, self.unmap, run, what)
                    .await
                    .0
            }
        }
    }

    /// Zeroes a range.
    pub async fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let start = now_ns();
        if let Err(e) = self.check_write(offset, len) {
            self.stats.refused(Op::Write, &e);
            return Err(e);
        }
        let run = |may_unmap: bool| async move {
            let r = self.driver.write_zeroes(offset, len, may_unmap).await;
            self.wrote(start, offset, len, &r);
            (r, may_unmap)
        };
        let may_unmap = may_unmap && self.unmap;
        match self.hooks.current() {
            None => run(may_unmap).await.0,
            Some(hooks) => {
                let what = |&may_unmap: &bool| (hook::Written::Zeroes { may_unmap }, true);
                let span = (Op::Write, offset, len);
                self.write_hooked(hooks, span, may_unmap, run, what).await.0
            }
        }
    }

    /// Allocation status of the first extent of a range.
    pub async fn block_status(&self, offset: u64, len: u64) -> io::Result<BlockStatus> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Err(einval("empty block-status request"));
        }
        // Held as a read: a point-in-time reader must not see a status the write after a
        // copy changed (see [`hook`]).
        let status = || async {
            match self.driver.block_status_cached(offset, len) {
                Some(st) => Ok(st),
                None => self.driver.block_status(offset, len).await,
            }
        };
        let mut st = match self.hooks.current() {
            None => status().await?,
            Some(hooks) => self.read_hooked(hooks, (offset, len), status).await?,
        };
        st.len = st.len.clamp(1, len);
        Ok(st)
    }

    /// The allocation depth of the first extent of a range (see
    /// [`BlockDriver::allocation_depth`]).
    pub async fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u64, u32)> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Err(einval("empty block-status request"));
        }
        let (n, depth) = self.driver.allocation_depth(offset, len).await?;
        Ok((n.clamp(1, len), depth))
    }

    /// Resizes.
    pub async fn resize(&self, size: u64) -> io::Result<()> {
        self.resize_with(size, false).await
    }

    /// Changes the size, the new area allocated where the storage can (a FUSE client's
    /// fallocate past the end, as qsd grows with `preallocation=falloc`).
    pub async fn resize_preallocated(&self, size: u64) -> io::Result<()> {
        self.resize_with(size, true).await
    }

    async fn resize_with(&self, size: u64, falloc: bool) -> io::Result<()> {
        self.check_writable()?;
        // The image's bitmaps are resized in memory and stored at close: those whose bits
        // cannot be trusted or changed block it (QEMU's qcow2_truncate_bitmaps_check).
        for b in self.bitmaps().iter().filter(|b| b.is_persistent()) {
            b.check(dirty_bitmap::Use::Modify)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        }
        if self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|b| !dirty_bitmap::fits(size, b.granularity()))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a dirty bitmap of this node could not cover that size",
            ));
        }
        if falloc {
            self.driver.resize_falloc(size).await?;
        } else {
            self.driver.resize(size).await?;
        }
        for b in self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            b.resize(size);
        }
        Ok(())
    }
}
