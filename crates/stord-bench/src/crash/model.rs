//! What the guest may read back after a crash: every sector it wrote carries its own
//! name (a magic, its guest sector, the number of the request that wrote it), so a sector
//! read back is known to be zero, one of this sector's writes, another offset's data or
//! garbage; and the history of each sector's requests gives the values allowed at a crash
//! whose last durable client flush is known.

use std::collections::HashMap;

/// The guest's sector.
pub const SECTOR: u64 = 512;
const MAGIC: &[u8; 8] = b"STORDCRS";

/// What a sector holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Val {
    Zero,
    /// Written by request `op`.
    Data(u32),
}

/// A sector as read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    Val(Val),
    /// Data some request wrote at another guest sector.
    Elsewhere {
        sector: u64,
        op: u32,
    },
    Garbage,
}

/// The bytes request `op` writes at guest sector `s`.
pub fn sector_bytes(s: u64, op: u32) -> [u8; SECTOR as usize] {
    let mut b = [0u8; SECTOR as usize];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&s.to_le_bytes());
    b[16..20].copy_from_slice(&op.to_le_bytes());
    let fill = (s ^ (u64::from(op) << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for (i, c) in b[24..].chunks_mut(8).enumerate() {
        c.copy_from_slice(&fill.rotate_left(i as u32).to_le_bytes());
    }
    b
}

/// Names what a sector read back holds.
pub fn classify(b: &[u8]) -> Read {
    if b.iter().all(|&x| x == 0) {
        return Read::Val(Val::Zero);
    }
    if &b[..8] != MAGIC {
        return Read::Garbage;
    }
    let s = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let op = u32::from_le_bytes(b[16..20].try_into().unwrap());
    if b != sector_bytes(s, op) {
        return Read::Garbage;
    }
    Read::Elsewhere { sector: s, op }
}

/// One request's effect on a sector.
#[derive(Clone, Copy, Debug)]
enum Event {
    Set(Val),
    /// A discard: the sector may read zero from then on, or what it held.
    MaybeZero,
}

/// Every request the guest made, per sector, in order.
#[derive(Default)]
pub struct Model {
    history: HashMap<u64, Vec<(u32, Event)>>,
    /// The next request's number.
    pub next_op: u32,
}

impl Model {
    /// Numbers a request; its sectors are then recorded under that number.
    pub fn begin(&mut self) -> u32 {
        self.next_op += 1;
        self.next_op
    }

    pub fn wrote(&mut self, op: u32, first: u64, n: u64) {
        self.record(op, first, n, Event::Set(Val::Data(op)));
    }
    pub fn zeroed(&mut self, op: u32, first: u64, n: u64) {
        self.record(op, first, n, Event::Set(Val::Zero));
    }
    pub fn discarded(&mut self, op: u32, first: u64, n: u64) {
        self.record(op, first, n, Event::MaybeZero);
    }

    fn record(&mut self, op: u32, first: u64, n: u64, e: Event) {
        for s in first..first + n {
            self.history.entry(s).or_default().push((op, e));
        }
    }

    /// The values sector `s` may read back when every request numbered below `durable`
    /// is durable and later ones (up to `upto`, exclusive) may or may not have landed.
    pub fn allowed(&self, s: u64, durable: u32, upto: u32) -> Vec<Val> {
        let mut set = vec![Val::Zero];
        for &(op, e) in self.history.get(&s).into_iter().flatten() {
            if op >= upto {
                break;
            }
            let v = match e {
                Event::Set(v) => v,
                Event::MaybeZero => Val::Zero,
            };
            match e {
                Event::Set(_) if op < durable => set = vec![v],
                _ if !set.contains(&v) => set.push(v),
                _ => {}
            }
        }
        set
    }

    /// Checks an image read back (raw, from guest sector 0) against what is allowed; the
    /// first few sectors that are not, described.
    pub fn check(&self, raw: &[u8], durable: u32, upto: u32) -> (u64, Vec<String>) {
        let mut bad = 0;
        let mut seen = Vec::new();
        for (s, b) in raw.chunks(SECTOR as usize).enumerate() {
            let s = s as u64;
            let got = match classify(b) {
                Read::Elsewhere { sector, op } if sector == s => Read::Val(Val::Data(op)),
                r => r,
            };
            let allowed = self.allowed(s, durable, upto);
            if matches!(got, Read::Val(v) if allowed.contains(&v)) {
                continue;
            }
            bad += 1;
            if seen.len() < 4 {
                seen.push(format!("sector {s}: read {got:?}, allowed {allowed:?}"));
            }
        }
        (bad, seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sectors_name_themselves() {
        let b = sector_bytes(7, 3);
        assert_eq!(classify(&b), Read::Elsewhere { sector: 7, op: 3 });
        assert_eq!(classify(&[0; 512]), Read::Val(Val::Zero));
        let mut torn = b;
        torn[300] ^= 1;
        assert_eq!(classify(&torn), Read::Garbage);
    }

    #[test]
    fn durable_writes_are_required_and_later_ones_optional() {
        let mut m = Model::default();
        let a = m.begin();
        m.wrote(a, 0, 2);
        let b = m.begin();
        m.wrote(b, 1, 1);
        let flush = m.next_op + 1;
        let c = m.begin();
        m.zeroed(c, 0, 1);
        let d = m.begin();
        m.discarded(d, 1, 1);
        // Before any flush: anything each sector was ever set to, or zero.
        assert_eq!(m.allowed(0, 0, u32::MAX), vec![Val::Zero, Val::Data(a)]);
        // After the flush: the flushed value, or what came later.
        assert_eq!(m.allowed(0, flush, u32::MAX), vec![Val::Data(a), Val::Zero]);
        assert_eq!(m.allowed(1, flush, u32::MAX), vec![Val::Data(b), Val::Zero]);
        assert_eq!(m.allowed(1, flush, d), vec![Val::Data(b)]);
        assert_eq!(m.allowed(2, flush, u32::MAX), vec![Val::Zero]);
        // A discard before the flush leaves old data or zero.
        assert_eq!(
            m.allowed(1, u32::MAX, u32::MAX),
            vec![Val::Data(b), Val::Zero]
        );
        let mut raw = [sector_bytes(0, a), sector_bytes(1, b), [0; 512]].concat();
        assert_eq!(m.check(&raw, flush, u32::MAX).0, 0);
        raw[1024..1536].copy_from_slice(&sector_bytes(0, a));
        let (bad, what) = m.check(&raw, flush, u32::MAX);
        assert_eq!(bad, 1);
        assert!(what[0].contains("Elsewhere"), "{what:?}");
    }
}
