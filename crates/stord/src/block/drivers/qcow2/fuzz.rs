//! Fuzz entries. Over whole small images (`fuzz/fuzz_targets/qcow2_image.rs`): the
//! image's header and tables, opened read-write as stord opens them, then a few guest
//! requests. Whatever the tables say, the driver must answer with errors, never crash or
//! hang, and never write over the header. Over a header's bytes alone
//! (`fuzz/fuzz_targets/qcow2_header.rs`, reached as `qcow2::fuzz`): the parser and the
//! table codecs.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::driver::Qcow2Driver;
use super::header::Header;
use super::image::Image;
use super::options::Qcow2Options;
use super::subcluster;
use super::table::{EntryCodec, Mapping, RefcountCodec};
use crate::block::drivers::file;
use crate::block::drivers::file::{AioMode, DiscardMode, FileOptions, NativeTuning};
use crate::block::node::block_node::{BlockDriver, BlockNode};
use crate::buf::request_buf;

/// The largest image a run takes (and a request's length).
const MAX_IMAGE: usize = 1 << 20;
const MAX_REQUEST: u64 = 256 << 10;

/// `data`: one byte `n`, then the image, then `n` bytes of requests, 8 each (kind, a
/// 4-byte offset in 512-byte units, a 2-byte length in 512-byte units, a pattern byte).
pub fn fuzz_image(data: &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let ops_len = (n as usize).min(rest.len());
    let (image, ops) = rest.split_at(rest.len() - ops_len);
    if image.len() > MAX_IMAGE || image.len() < 104 {
        return;
    }
    let Ok(mut f) = crate::sys::memfd_create("qcow2-fuzz") else {
        return;
    };
    if f.write_all(image).is_err() {
        return;
    }
    let opts = FileOptions {
        filename: format!("/proc/self/fd/{}", f.as_raw_fd()),
        aio: AioMode::Threads,
        direct: false,
        native: NativeTuning {
            max_batch: 0,
            reap_after_submit: true,
        },
        discard: DiscardMode::Unmap,
        read_only: false,
        locking: false,
        no_flush: false,
    };
    let Ok(drv) = file::open(opts) else {
        return;
    };
    let node = Arc::new(BlockNode::new("file".into(), drv, false, false));
    let Ok(ctx) = stord_aio::AioContext::new(Default::default()) else {
        return;
    };
    let header_before = image[..36].to_vec();
    let ops = ops.to_vec();
    let n2 = node.clone();
    ctx.block_on(async move {
        let node = n2;
        let Ok(img) = Image::load(&node, true).await else {
            return;
        };
        let opts = Qcow2Options {
            discard: true,
            ..Default::default()
        };
        let q = Qcow2Driver::new(node.clone(), None, img, &opts);
        let size = q.size();
        if size == 0 {
            return;
        }
        for op in ops.chunks_exact(8) {
            let off =
                (u32::from_le_bytes(op[1..5].try_into().expect("4 bytes")) as u64 * 512) % size;
            let len = (u16::from_le_bytes(op[5..7].try_into().expect("2 bytes")) as u64 * 512)
                .clamp(1, MAX_REQUEST)
                .min(size - off);
            let _ = match op[0] % 6 {
                0 => q.read(off, request_buf(len as usize)).await.0,
                1 | 2 => {
                    let mut b = request_buf(len as usize);
                    b.fill(op[7]);
                    q.write(off, b, op[0] & 0x80 != 0).await.0
                }
                3 => q.write_zeroes(off, len, op[0] & 0x80 != 0).await,
                4 => q.discard(off, len).await,
                _ => q.flush().await,
            };
        }
        let _ = q.flush().await;
    });
    // Nothing the requests did may have touched the header's fixed fields.
    let (r, now) = ctx.block_on(async move { node.read(0, request_buf(36)).await });
    if r.is_ok() {
        assert_eq!(&now[..], &header_before[..], "the header was overwritten");
    }
}

/// Fuzz entry (`fuzz/fuzz_targets/qcow2_header.rs`): `data` as the start of an image; if
/// its header parses, every 8 bytes of it (16 with extended L2 entries: entry and
/// subcluster bitmap, then the subcluster arithmetic over them) decoded as an L2 entry
/// and all of it read as a refcount block, with the header's geometry.
pub fn fuzz_header(data: &[u8]) {
    let _ = Header::bytes_needed(data);
    let Ok(h) = Header::parse(data) else {
        return;
    };
    assert!((9..=21).contains(&h.cluster_bits) && h.refcount_order <= 6);
    let codec = EntryCodec::new(h.cluster_bits, h.version, h.extended_l2());
    let word = |w: &[u8]| u64::from_be_bytes(w.try_into().expect("8 bytes"));
    for w in data.chunks_exact(8 * codec.words()) {
        let (e, bitmap) = if h.extended_l2() {
            (word(&w[..8]), word(&w[8..]))
        } else {
            (word(w), 0)
        };
        if let (Ok(map), true) = (codec.decode_pair(e, bitmap), h.extended_l2()) {
            check_subclusters(map, bitmap, h.cluster_bits - 5);
        }
    }
    let rc = RefcountCodec::new(h.refcount_order);
    let entries = (data.len() * 8) >> h.refcount_order;
    for i in 0..entries {
        assert!(rc.get(data, i) <= rc.max());
    }
}

/// The subcluster arithmetic over an entry that decoded: runs cover the cluster and stay
/// in it, and a copy-on-write span holds the write, stays in the cluster, and leaves the
/// written subclusters allocated and not zero.
fn check_subclusters(map: Mapping, bitmap: u64, sc_bits: u32) {
    let mut sc = 0;
    while sc < subcluster::PER_CLUSTER {
        let (_, n) = subcluster::run(map, bitmap, sc);
        assert!(
            n >= 1 && sc + n <= subcluster::PER_CLUSTER,
            "run {n} at {sc}"
        );
        sc += n;
    }
    let cs = u64::from(subcluster::PER_CLUSTER) << sc_bits;
    // A write picked from the bitmap's bits, so every shape gets tried.
    let from = (bitmap.rotate_left(7) % cs) & !511;
    let to = (from + 512 + (bitmap >> 40) % cs).min(cs);
    for keep in [false, matches!(map, Mapping::Data { copied: true, .. })] {
        let (a, b) = subcluster::cow_span(map, bitmap, keep, (from, to), sc_bits);
        assert!(
            a <= from && to <= b && b <= cs,
            "span {a}..{b} for {from}..{to}"
        );
        let after = subcluster::written(bitmap, (a, b), sc_bits);
        let first = (from >> sc_bits) as u32;
        assert!(subcluster::all_alloc(
            after,
            first,
            ((to - 1) >> sc_bits) as u32
        ));
        assert_eq!(after & (after >> 32), 0, "allocated and zero at once");
    }
}

#[cfg(test)]
mod tests {
    /// The committed seeds (among them inputs the fuzzer once broke or timed out on), run
    /// on every `cargo test`, each within a few seconds.
    #[test]
    fn committed_seeds_run_clean() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/qcow2_image");
        let mut n = 0;
        for e in std::fs::read_dir(dir).expect("the corpus") {
            let path = e.expect("an entry").path();
            if path
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with("seed-"))
            {
                let t = std::time::Instant::now();
                super::fuzz_image(&std::fs::read(&path).expect("a seed"));
                // The fuzzer gives an input 10 s (optimised); one seed took 29 s here.
                assert!(
                    t.elapsed() < std::time::Duration::from_secs(5),
                    "{} took {:?}",
                    path.display(),
                    t.elapsed()
                );
                n += 1;
            }
        }
        assert!(n > 0, "no seeds in {dir}");
    }

    /// The header target's committed seeds (an extended-L2 header with entries among
    /// them, whose subcluster arithmetic is checked).
    #[test]
    fn committed_header_seeds_run_clean() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/corpus/qcow2_header"
        );
        let mut extended = 0;
        for e in std::fs::read_dir(dir).expect("the corpus") {
            let data = std::fs::read(e.expect("an entry").path()).expect("a seed");
            super::fuzz_header(&data);
            let h = super::Header::parse(&data);
            extended += usize::from(h.is_ok_and(|h| h.extended_l2()));
        }
        assert!(
            extended > 0,
            "no extended-L2 header among the seeds in {dir}"
        );
    }
}
