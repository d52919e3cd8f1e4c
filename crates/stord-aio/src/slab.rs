//! A minimal slab: values addressed by a small index, slots reused, with a generation
//! counter so that a stale index (from a removed value) is recognised, not misdirected.

/// A slab with generation-checked keys.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    slots: Vec<(u32, Option<T>)>,
    free: Vec<usize>,
    len: usize,
}

/// A slab key: index plus the generation of the value it was issued for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) index: usize,
    pub(crate) gen: u32,
}

impl Key {
    /// Packs the key under an 8-bit tag into io_uring / epoll user data.
    pub(crate) fn to_token(self, tag: u8) -> u64 {
        ((tag as u64) << 56) | (((self.gen & 0xff_ffff) as u64) << 32) | self.index as u64
    }
    /// Unpacks `(tag, key)` from user data.
    pub(crate) fn from_token(t: u64) -> (u8, Key) {
        (
            (t >> 56) as u8,
            Key {
                index: (t & 0xffff_ffff) as usize,
                gen: ((t >> 32) & 0xff_ffff) as u32,
            },
        )
    }
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    pub(crate) fn insert(&mut self, v: T) -> Key {
        self.len += 1;
        if let Some(index) = self.free.pop() {
            let slot = &mut self.slots[index];
            slot.0 = (slot.0 + 1) & 0xff_ffff;
            slot.1 = Some(v);
            Key { index, gen: slot.0 }
        } else {
            self.slots.push((0, Some(v)));
            Key {
                index: self.slots.len() - 1,
                gen: 0,
            }
        }
    }

    /// The key the next `insert` will return.
    pub(crate) fn next_key(&self) -> Key {
        match self.free.last() {
            Some(&index) => Key {
                index,
                gen: (self.slots[index].0 + 1) & 0xff_ffff,
            },
            None => Key {
                index: self.slots.len(),
                gen: 0,
            },
        }
    }

    pub(crate) fn get(&self, k: Key) -> Option<&T> {
        match self.slots.get(k.index) {
            Some((g, Some(v))) if *g == k.gen => Some(v),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, k: Key) -> Option<&mut T> {
        match self.slots.get_mut(k.index) {
            Some((g, Some(v))) if *g == k.gen => Some(v),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, k: Key) -> Option<T> {
        match self.slots.get_mut(k.index) {
            Some((g, slot @ Some(_))) if *g == k.gen => {
                self.free.push(k.index);
                self.len -= 1;
                slot.take()
            }
            _ => None,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn keys(&self) -> Vec<Key> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (_, v))| v.is_some())
            .map(|(index, (gen, _))| Key { index, gen: *gen })
            .collect()
    }

    pub(crate) fn drain(&mut self) -> Vec<T> {
        self.free.clear();
        self.len = 0;
        self.slots.drain(..).filter_map(|(_, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_keys_miss_after_reuse() {
        let mut s = Slab::default();
        let a = s.insert(1);
        assert_eq!(s.remove(a), Some(1));
        let next = s.next_key();
        let b = s.insert(2);
        assert_eq!(next, b);
        assert_eq!(a.index, b.index);
        assert_eq!(s.get(a), None);
        assert_eq!(s.get(b), Some(&2));
        let (tag, k) = Key::from_token(b.to_token(7));
        assert_eq!((tag, k), (7, b));
        assert_eq!(s.len(), 1);
    }
}
