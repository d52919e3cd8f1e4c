//! The crash points of one log, under the model file systems are tested with
//! (dm-log-writes in xfstests, CrashMonkey): what came before a flush entry persists; of the
//! entries after it, up to the next flush, any subset persists, each whole or as any subset
//! of its sectors. A point is the flush it follows and, for a torn point, the seed that
//! picks the subset; the last point is the whole log.

use std::fs::File;
use std::io;

use super::log::Log;

/// xorshift64*: the seeded choices of points and subsets, repeatable from `--seed`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A number below `n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One crash point.
#[derive(Clone, Copy, Debug)]
pub struct Point {
    /// Entries before this index persist whole (it is one past a flush entry, or 0).
    pub prefix: usize,
    /// The entries from `prefix` to `window_end` that may persist, chosen by this seed;
    /// none for a clean point.
    pub torn: Option<u64>,
    pub window_end: usize,
}

/// The places a crash may cut: 0 and one past every flush entry, with the next flush (or
/// the log's end) after each.
fn cuts(log: &Log) -> Vec<(usize, usize)> {
    let mut starts = vec![0];
    starts.extend(log.flushes().into_iter().map(|f| f + 1));
    starts.dedup();
    let n = log.entries.len();
    let mut out = Vec::new();
    for (i, &s) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(n, |&e| e - 1);
        if s <= n {
            out.push((s, end.max(s)));
        }
    }
    out
}

/// About `want` points, half clean and half torn, spread evenly over the flushes, in
/// the order of their prefixes; then the whole log.
pub fn choose(log: &Log, want: usize, rng: &mut Rng) -> Vec<Point> {
    let cuts = cuts(log);
    let each = (want / 2).max(1);
    let pick = |k: usize| -> Vec<usize> {
        if cuts.len() <= k {
            return (0..cuts.len()).collect();
        }
        (0..k).map(|i| i * cuts.len() / k).collect()
    };
    let mut points: Vec<Point> = pick(each)
        .into_iter()
        .map(|i| Point {
            prefix: cuts[i].0,
            torn: None,
            window_end: cuts[i].1,
        })
        .collect();
    let torn: Vec<usize> = cuts
        .iter()
        .enumerate()
        .filter(|(_, c)| c.1 > c.0)
        .map(|(i, _)| i)
        .collect();
    // Torn points in every window in turn (several in one window when there are few:
    // each picks another subset), or in windows drawn at random.
    for k in 0..each {
        if torn.is_empty() {
            break;
        }
        let i = if torn.len() <= each {
            torn[k % torn.len()]
        } else {
            torn[rng.below(torn.len() as u64) as usize]
        };
        points.push(Point {
            prefix: cuts[i].0,
            torn: Some(rng.next()),
            window_end: cuts[i].1,
        });
    }
    points.sort_by_key(|p| (p.prefix, p.torn.is_some()));
    let n = log.entries.len();
    points.push(Point {
        prefix: n,
        torn: None,
        window_end: n,
    });
    points
}

/// Replays onto `dev` the entries of the point's window that its seed keeps: each entry
/// kept with one chance in two, a kept write torn (a random subset of its sectors) with
/// one in four. Returns how many entries it replayed.
pub fn replay_window(log: &Log, p: &Point, dev: &File) -> io::Result<usize> {
    let Some(seed) = p.torn else { return Ok(0) };
    let mut rng = Rng::new(seed);
    let mut n = 0;
    for i in p.prefix..p.window_end {
        if rng.below(2) == 0 {
            continue;
        }
        n += 1;
        if rng.below(4) == 0 {
            let mask = rng.next();
            log.replay(i, dev, &|s| (mask.rotate_left(s as u32) & 1) == 1)?;
        } else {
            log.replay(i, dev, &|_| true)?;
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_repeats_from_its_seed() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..5).map(|_| a.below(10)).collect();
        let ys: Vec<u64> = (0..5).map(|_| b.below(10)).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|&x| x < 10));
        assert_ne!(Rng::new(8).next(), Rng::new(7).next());
    }
}
