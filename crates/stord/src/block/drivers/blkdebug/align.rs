//! blkdebug's requests at its `align`: what QEMU's generic layer does before a request
//! reaches the driver (bdrv_pad_request, bdrv_padding_rmw_read, bdrv_aligned_pwritev),
//! with the write events it raises on the node on the way. Reads are widened to the
//! aligned blocks; a write that is not aligned reads its head and tail block first
//! (`pwritev_rmw_*`), under a lock on those blocks, and writes them whole.

use std::io;

use super::{BlkdebugDriver, IoType};
use crate::block::node::block_node::BlockDriver;
use crate::block::node::debug_event::DebugEvent;
use crate::buf::{request_buf, Buf};

impl BlkdebugDriver {
    /// The aligned blocks that cover `[offset, offset + len)`, within the child.
    fn covering(&self, offset: u64, len: u64) -> (u64, u64) {
        let a = self.align();
        let start = offset / a * a;
        let end = (offset + len)
            .next_multiple_of(a)
            .min(self.child.size().max(offset + len));
        (start, end)
    }

    /// A read at the alignment (widened into a buffer of ours when it is not).
    pub(super) async fn read_aligned(&self, offset: u64, buf: Buf) -> (io::Result<()>, Buf) {
        let len = buf.len() as u64;
        let (start, end) = self.covering(offset, len);
        if (start, end) == (offset, offset + len) {
            return self.child.driver().read(offset, buf).await;
        }
        let (r, wide) = self
            .child
            .driver()
            .read(start, request_buf((end - start) as usize))
            .await;
        let mut buf = buf;
        if r.is_ok() {
            let skip = (offset - start) as usize;
            let n = buf.len();
            buf.copy_from_slice(&wide[skip..skip + n]);
        }
        (r, buf)
    }

    /// One block read for a padded write, between its two events.
    async fn rmw_block(
        &self,
        at: u64,
        before: DebugEvent,
        after: DebugEvent,
        out: &mut [u8],
    ) -> io::Result<()> {
        self.event(before);
        let (r, b) = Box::pin(BlockDriver::read(self, at, request_buf(out.len()))).await;
        self.event(after);
        r?;
        out.copy_from_slice(&b);
        Ok(())
    }

    /// A write of `data` at `offset`, padded to the alignment as QEMU pads it, with the
    /// events of its way through the generic layer.
    pub(super) async fn write_padded(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let len = data.len() as u64;
        let (start, end) = self.covering(offset, len);
        if (start, end) == (offset, offset + len) {
            return self.write_aligned(offset, data, fua).await;
        }
        let _lock = self.rmw.lock(start, end).await;
        let a = self.align();
        let mut whole = vec![0u8; (end - start) as usize];
        let last = start + ((end - start).div_ceil(a) - 1) * a;
        if offset != start {
            let n = ((last.max(start + a)).min(end) - start) as usize;
            let n = if last == start { whole.len() } else { n };
            self.rmw_block(
                start,
                DebugEvent::PwritevRmwHead,
                DebugEvent::PwritevRmwAfterHead,
                &mut whole[..n],
            )
            .await?;
        }
        // The tail block, unless it is the head block already read.
        if offset + len != end && (last != start || offset == start) {
            let from = (last - start) as usize;
            self.rmw_block(
                last,
                DebugEvent::PwritevRmwTail,
                DebugEvent::PwritevRmwAfterTail,
                &mut whole[from..],
            )
            .await?;
        }
        let skip = (offset - start) as usize;
        whole[skip..skip + data.len()].copy_from_slice(data);
        self.write_aligned(start, &whole, fua).await
    }

    /// An aligned write: `pwritev`, the rules, the child's write, `pwritev_done`.
    async fn write_aligned(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.event(DebugEvent::Pwritev);
        let r = match self.fault(IoType::Write, offset, data.len() as u64) {
            Some(f) => Err(Self::suffer(f).await),
            None => {
                let mut buf = request_buf(data.len());
                buf.copy_from_slice(data);
                self.child.driver().write(offset, buf, fua).await.0
            }
        };
        self.event(DebugEvent::PwritevDone);
        r
    }

    /// Write-zeroes: its unaligned ends as padded writes of zeroes, the aligned middle as
    /// a write-zeroes (`pwritev_zero`, the rules, the child's, `pwritev_done`).
    pub(super) async fn write_zeroes_padded(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> io::Result<()> {
        let a = self.align();
        let end = offset + len;
        let (mid_start, mid_end) = (offset.next_multiple_of(a), end / a * a);
        if mid_start >= mid_end {
            return self
                .write_padded(offset, &vec![0u8; len as usize], false)
                .await;
        }
        if offset < mid_start {
            let head = vec![0u8; (mid_start - offset) as usize];
            self.write_padded(offset, &head, false).await?;
        }
        self.event(DebugEvent::PwritevZero);
        let r = match self.fault(IoType::WriteZeroes, mid_start, mid_end - mid_start) {
            Some(f) => Err(Self::suffer(f).await),
            None => {
                self.child
                    .driver()
                    .write_zeroes(mid_start, mid_end - mid_start, may_unmap)
                    .await
            }
        };
        self.event(DebugEvent::PwritevDone);
        r?;
        if mid_end < end {
            let tail = vec![0u8; (end - mid_end) as usize];
            self.write_padded(mid_end, &tail, false).await?;
        }
        Ok(())
    }
}
