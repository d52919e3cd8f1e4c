//! `blkdebug`: QEMU's fault injector, a filter over its child `image`.
//!
//! A format driver above it announces the steps of its work as debug events
//! ([`crate::block::node::debug_event`]); the rules ([`rules`]: `inject-error`,
//! `set-state`, from the options or a `config` file) move a state machine and arm errors
//! that the requests reaching this node then meet. The node also raises the write events
//! QEMU's generic layer raises on it (`pwritev`, `pwritev_zero`, `pwritev_done`, and the
//! `pwritev_rmw_*` of a padded write). `align` and the other limits are what the node
//! reports; a request that is not aligned is padded here (QEMU's generic layer pads it
//! before blkdebug sees it): reads are widened, writes read their head and tail first,
//! under a lock on the blocks they patch.

mod align;
pub mod rules;

use std::io;
use std::sync::{Arc, Mutex};

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::{BlockDriver, BlockNode, BlockStatus};
use crate::block::node::debug_event::DebugEvent;
use crate::block::node::future::BoxFut;
use crate::block::node::limits::BlockLimits;
use crate::block::node::perm::Perm;
use crate::block::node::range_lock::RangeLocks;
use crate::block::open::{GraphError, Opened};
use crate::buf::Buf;
use crate::cli::keyval::KeyVal;
use crate::cli::Help;
use rules::{Fault, IoType, Rules};

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["blkdebug"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "image=<node> | ,image.driver=...\n\
                   [,config=<file>][,align=<n>][,max-transfer=<n>]\n\
                   [,opt-write-zero=<n>][,max-write-zero=<n>][,opt-discard=<n>][,max-discard=<n>]\n\
                   [,inject-error.0.event=<event>[,inject-error.0.errno=<n>][,...]]\n\
                   [,set-state.0.event=<event>,set-state.0.state=<n>,set-state.0.new_state=<n>]\n\
                   [,take-child-perms.0=<perm>][,unshare-child-perms.0=<perm>]",
        about: "QEMU's fault injector over `image`: errors armed by the debug\n\
                events of the format above it, for tests",
    },
    create: None,
    amend: None,
    open: |g, kv, flags| {
        let o = Options::take(kv)?;
        let child = g.child(kv, "image")?;
        let driver = BlkdebugDriver::new(child, o)?;
        Ok(Opened {
            read_only: flags.read_only || driver.child.is_read_only(),
            direct: driver.child.direct,
            driver: Box::new(driver),
            bitmaps: Vec::new(),
        })
    },
};

/// The options beside `image`.
struct Options {
    rules: Rules,
    align: u64,
    max_transfer: u64,
    opt_write_zero: u64,
    max_write_zero: u64,
    opt_discard: u64,
    max_discard: u64,
    take: Perm,
    unshare: Perm,
}

fn perms(kv: &mut KeyVal, key: &str) -> Result<Perm, GraphError> {
    let mut p = Perm::NONE;
    for name in kv.take_list(key) {
        let named = Perm::NAMED
            .iter()
            .find(|(_, n)| n.replace(' ', "-") == name)
            .ok_or_else(|| {
                GraphError::Invalid(format!("Parameter '{key}' does not accept value '{name}'"))
            })?;
        p = p | named.0;
    }
    Ok(p)
}

impl Options {
    fn take(kv: &mut KeyVal) -> Result<Options, GraphError> {
        let (mut inject, mut set) = match kv.take("config") {
            None => (Vec::new(), Vec::new()),
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    GraphError::Invalid(format!(
                        "Could not read blkdebug config file: {}",
                        crate::sys::os_text(&e)
                    ))
                })?;
                rules::from_config(&text)?
            }
        };
        let (i, s) = rules::from_options(kv)?;
        inject.extend(i);
        set.extend(s);
        let mut n = |k: &str| kv.take_u64(k, true).map(|v| v.unwrap_or(0));
        Ok(Options {
            align: n("align")?,
            max_transfer: n("max-transfer")?,
            opt_write_zero: n("opt-write-zero")?,
            max_write_zero: n("max-write-zero")?,
            opt_discard: n("opt-discard")?,
            max_discard: n("max-discard")?,
            rules: Rules::new(inject, set),
            take: perms(kv, "take-child-perms")?,
            unshare: perms(kv, "unshare-child-perms")?,
        })
    }

    /// QEMU's checks of the limits against the alignment (its words).
    fn check(&self, child_align: u64) -> Result<(), GraphError> {
        let bad = |what: &str, v: u64| {
            Err(GraphError::Invalid(format!(
                "Cannot meet constraints with {what} {v}"
            )))
        };
        const INT_MAX: u64 = i32::MAX as u64;
        if self.align != 0 && (!self.align.is_power_of_two() || self.align >= INT_MAX) {
            return bad("align", self.align);
        }
        let a = self.align.max(child_align).max(1);
        let fits = |v: u64, multiple: u64| v < INT_MAX && v.is_multiple_of(multiple.max(1));
        for (what, v, m) in [
            ("max-transfer", self.max_transfer, a),
            ("opt-write-zero", self.opt_write_zero, a),
            (
                "max-write-zero",
                self.max_write_zero,
                self.opt_write_zero.max(a),
            ),
            ("opt-discard", self.opt_discard, a),
            ("max-discard", self.max_discard, self.opt_discard.max(a)),
        ] {
            if !fits(v, m) {
                return bad(what, v);
            }
        }
        Ok(())
    }
}

/// The blkdebug filter.
pub struct BlkdebugDriver {
    child: Arc<BlockNode>,
    rules: Mutex<Rules>,
    o: Options,
    /// Blocks a padded write patches, so that two cannot lose each other's bytes.
    rmw: RangeLocks,
}

impl BlkdebugDriver {
    fn new(child: Arc<BlockNode>, o: Options) -> Result<Self, GraphError> {
        o.check(u64::from(child.limits().request_alignment))?;
        let rules = Mutex::new(o.rules.clone());
        let d = BlkdebugDriver {
            child,
            rules,
            o,
            rmw: RangeLocks::default(),
        };
        d.event(DebugEvent::Nothing);
        Ok(d)
    }

    /// The fault a request of `kind` meets, if any.
    fn fault(&self, kind: IoType, offset: u64, bytes: u64) -> Option<Fault> {
        let mut r = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        if !r.armed() {
            return None;
        }
        let f = r.check(kind, offset, bytes);
        if let Some(f) = f {
            tracing::debug!(
                "blkdebug: {kind:?} at {offset} (+{bytes}) fails with errno {}",
                f.errno
            );
        }
        f
    }

    fn event(&self, e: DebugEvent) {
        tracing::trace!("blkdebug: event {}", e.name());
        self.rules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .event(e);
    }

    /// What `fault` does to a request before it fails (or, with errno 0, goes on): its
    /// delay, and the yield to the loop QEMU makes unless `immediately`.
    async fn suffer(f: Fault) -> io::Error {
        if f.delay_ns > 0 {
            stord_aio::sleep(std::time::Duration::from_nanos(f.delay_ns)).await;
        } else if !f.immediately {
            stord_aio::yield_now().await;
        }
        f.error()
    }

    /// The alignment requests reach the child with.
    fn align(&self) -> u64 {
        self.o.align.max(1)
    }
}

impl BlockDriver for BlkdebugDriver {
    fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn driver_name(&self) -> &'static str {
        "blkdebug"
    }
    fn size(&self) -> u64 {
        self.child.size()
    }
    fn debug_event(&self, e: DebugEvent) -> bool {
        self.event(e);
        true
    }
    fn read(&self, offset: u64, buf: Buf) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            if let Some(f) = self.fault(IoType::Read, offset, buf.len() as u64) {
                return (Err(Self::suffer(f).await), buf);
            }
            self.read_aligned(offset, buf).await
        })
    }
    fn write(&self, offset: u64, buf: Buf, fua: bool) -> BoxFut<'_, (io::Result<()>, Buf)> {
        Box::pin(async move {
            let r = self.write_padded(offset, &buf, fua).await;
            (r, buf)
        })
    }
    fn flush(&self) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if let Some(f) = self.fault(IoType::Flush, 0, 0) {
                return Err(Self::suffer(f).await);
            }
            self.child.driver().flush().await
        })
    }
    fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
        Box::pin(async move {
            if let Some(f) = self.fault(IoType::Discard, offset, len) {
                return Err(Self::suffer(f).await);
            }
            // The unaligned ends are dropped, as QEMU's generic layer drops them.
            let a = self.align();
            let (start, end) = (offset.next_multiple_of(a), (offset + len) / a * a);
            if start >= end {
                return Ok(());
            }
            self.child.driver_discard(start, end - start).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> BoxFut<'_, io::Result<()>> {
        Box::pin(self.write_zeroes_padded(offset, len, may_unmap))
    }
    fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
        Box::pin(async move {
            if let Some(f) = self.fault(IoType::BlockStatus, offset, len) {
                return Err(Self::suffer(f).await);
            }
            self.child.driver().block_status(offset, len).await
        })
    }
    fn resize(&self, size: u64) -> BoxFut<'_, io::Result<()>> {
        self.child.driver().resize(size)
    }
    fn filename(&self) -> Option<String> {
        self.child.filename()
    }
    fn no_flush(&self) -> bool {
        self.child.driver().no_flush()
    }
    fn allocated_bytes(&self) -> Option<u64> {
        self.child.allocated_bytes()
    }
    fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
        vec![("image", self.child.clone())]
    }
    fn refresh_limits(&self, bl: &mut BlockLimits) {
        let set = |field: &mut u32, v: u64| {
            if v != 0 {
                *field = v as u32;
            }
        };
        set(&mut bl.request_alignment, self.o.align);
        set(&mut bl.max_transfer, self.o.max_transfer);
        set(&mut bl.write_zeroes_alignment, self.o.opt_write_zero);
        set(&mut bl.discard_alignment, self.o.opt_discard);
        if self.o.max_write_zero != 0 {
            bl.max_write_zeroes = self.o.max_write_zero;
        }
        if self.o.max_discard != 0 {
            bl.max_discard = self.o.max_discard;
        }
    }
    fn child_perms(
        &self,
        _role: &'static str,
        perm: Perm,
        shared: Perm,
        _writable: bool,
    ) -> (Perm, Perm) {
        (perm | self.o.take, shared & self.o.unshare.complement())
    }
}
