//! A virtio-blk request's descriptor chain: the guest buffers it names, split by direction
//! ([`Chain`]), and the walk that reads them from the descriptor table with the checks the
//! virtio spec asks of a device ([`walk_chain`]). What a queue takes off its ring before a
//! request runs; the `virtio_blk_chain` fuzz target feeds it hostile tables.

use smallvec::SmallVec;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use super::device::MAX_REQUEST_BYTES;

/// One guest buffer: address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub len: u32,
}

/// A request's buffers, split by direction (inline up to four each: no allocation for the
/// usual header + data + status).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Chain {
    /// Device-readable (header, then write data or discard segments).
    pub out: SmallVec<[Segment; 4]>,
    /// Device-writable (read data, then the status byte).
    pub inn: SmallVec<[Segment; 4]>,
}

impl Chain {
    /// Splits descriptors; a readable descriptor after a writable one is malformed.
    #[cfg(test)]
    pub fn from_descriptors(descs: impl IntoIterator<Item = Descriptor>) -> Result<Self, String> {
        let mut c = Chain::default();
        for d in descs {
            c.push(d)?;
        }
        Ok(c)
    }

    /// The first address of a segment that `mem` does not map, if any.
    pub fn unmapped(&self, mem: &vm_memory::GuestMemoryMmap) -> Option<u64> {
        use vm_memory::GuestMemoryRegion;
        self.out.iter().chain(self.inn.iter()).find_map(|s| {
            let len = (s.len as usize).max(1);
            if mem.check_range(GuestAddress(s.addr), len) {
                return None;
            }
            // Region by region to the first byte no region holds.
            let end = s.addr.saturating_add(len as u64);
            let mut at = s.addr;
            while at < end {
                match mem.find_region(GuestAddress(at)) {
                    Some(r) => at = r.last_addr().0.checked_add(1)?,
                    None => return Some(at),
                }
            }
            None
        })
    }

    /// Appends the next descriptor of the chain.
    pub fn push(&mut self, d: Descriptor) -> Result<(), String> {
        let s = Segment {
            addr: d.addr().0,
            len: d.len(),
        };
        if d.is_write_only() {
            self.inn.push(s);
        } else if !self.inn.is_empty() {
            return Err("device-readable descriptor after a device-writable one".into());
        } else {
            self.out.push(s);
        }
        Ok(())
    }

    /// Bytes of the device-readable part.
    pub fn out_len(&self) -> u64 {
        self.out.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Bytes of the device-writable part.
    pub fn in_len(&self) -> u64 {
        self.inn.iter().map(|s| u64::from(s.len)).sum()
    }

    /// Bytes of the device-writable part before the status byte.
    pub fn data_in_len(&self) -> u64 {
        self.in_len().saturating_sub(1)
    }

    /// The most data the request can make us buffer: its read or write length (requests
    /// over the limit are refused without a buffer).
    pub fn data_cost(&self) -> usize {
        let write = self.out_len().saturating_sub(16);
        let cost = write.max(self.data_in_len());
        if cost > MAX_REQUEST_BYTES {
            0
        } else {
            cost as usize
        }
    }
}

/// Why a chain could not be read; `at`, when a descriptor's address is not mapped.
#[derive(Debug)]
pub struct WalkError {
    pub what: String,
    pub at: Option<u64>,
}

impl std::fmt::Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.what)
    }
}

impl From<String> for WalkError {
    fn from(what: String) -> Self {
        WalkError { what, at: None }
    }
}

impl From<&str> for WalkError {
    fn from(what: &str) -> Self {
        WalkError {
            what: what.into(),
            at: None,
        }
    }
}

/// Reads the descriptor chain starting at `head` (following one indirect table), with the
/// checks the virtio spec asks of a device: indices in range, no loops, a sane total length.
pub fn walk_chain(
    mem: &GuestMemoryMmap,
    table: GuestAddress,
    size: u16,
    head: u16,
) -> Result<Chain, WalkError> {
    let mut chain = Chain::default();
    let (mut table, mut size) = (table, size);
    let mut next = head;
    let mut budget = size as usize;
    let mut indirect = false;
    let mut total: u64 = 0;
    loop {
        if next >= size {
            return Err(format!("descriptor index {next} beyond table of {size}").into());
        }
        if budget == 0 {
            return Err("descriptor chain loops".into());
        }
        budget -= 1;
        let at = table
            .0
            .checked_add(16 * u64::from(next))
            .ok_or_else(|| format!("descriptor {next} beyond the address space"))?;
        let d: Descriptor = mem.read_obj(GuestAddress(at)).map_err(|e| WalkError {
            what: format!("descriptor {next} unreadable: {e}"),
            at: Some(at),
        })?;
        if d.flags() & VRING_DESC_F_INDIRECT as u16 != 0 {
            if indirect || chain.out.len() + chain.inn.len() > 0 {
                return Err("indirect table not at the head of the chain".into());
            }
            if !d.len().is_multiple_of(16) || d.len() == 0 || d.len() / 16 > u32::from(u16::MAX) {
                return Err(format!("indirect table of {} bytes", d.len()).into());
            }
            indirect = true;
            table = d.addr();
            size = (d.len() / 16) as u16;
            budget = size as usize;
            next = 0;
            continue;
        }
        total += u64::from(d.len());
        if total > u64::from(u32::MAX) {
            return Err("chain longer than 4 GiB".into());
        }
        let has_next = d.flags() & VRING_DESC_F_NEXT as u16 != 0;
        next = d.next();
        chain.push(d)?;
        if !has_next {
            return Ok(chain);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;

    fn desc(addr: u64, len: u32, write: bool) -> Descriptor {
        let flags = if write {
            virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16
        } else {
            0
        };
        Descriptor::new(addr, len, flags, 0)
    }

    #[test]
    fn unmapped_finds_the_first_byte_no_region_holds() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x4000), 0x1000),
        ])
        .unwrap();
        let c = Chain::from_descriptors([desc(0x100, 0x100, false)]).unwrap();
        assert_eq!(c.unmapped(&mem), None);
        // Across two adjacent regions into the gap.
        let c = Chain::from_descriptors([desc(0x800, 0x2000, false)]).unwrap();
        assert_eq!(c.unmapped(&mem), Some(0x2000));
        // A later segment, starting in the gap.
        let c = Chain::from_descriptors([desc(0, 16, false), desc(0x3000, 512, true)]).unwrap();
        assert_eq!(c.unmapped(&mem), Some(0x3000));
        // Mapped end to end across two regions.
        let c = Chain::from_descriptors([desc(0x800, 0x1000, true)]).unwrap();
        assert_eq!(c.unmapped(&mem), None);
    }

    #[test]
    fn chain_splits_by_direction() {
        let c = Chain::from_descriptors([
            desc(0, 16, false),
            desc(4096, 512, true),
            desc(8192, 1, true),
        ])
        .unwrap();
        assert_eq!(c.out.len(), 1);
        assert_eq!(c.inn.len(), 2);
        // The data is the first 512 writable bytes; the last byte is the status.
        assert_eq!(c.data_in_len(), 512);
        assert_eq!(
            c.inn[0],
            Segment {
                addr: 4096,
                len: 512
            }
        );
    }

    #[test]
    fn readable_after_writable_is_malformed() {
        assert!(Chain::from_descriptors([
            desc(0, 16, false),
            desc(16, 1, true),
            desc(32, 8, false)
        ])
        .is_err());
    }

    fn put(mem: &GuestMemoryMmap, table: u64, i: u16, d: Descriptor) {
        mem.write_obj(d, GuestAddress(table + 16 * u64::from(i)))
            .unwrap();
    }

    #[test]
    fn walks_direct_and_indirect_chains_and_refuses_loops() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        let (n, w) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
        put(&mem, 0, 0, Descriptor::new(0x1000, 16, n, 3));
        put(&mem, 0, 3, Descriptor::new(0x2000, 512, n | w, 1));
        put(&mem, 0, 1, Descriptor::new(0x3000, 1, w, 0));
        let c = walk_chain(&mem, GuestAddress(0), 8, 0).unwrap();
        assert_eq!((c.out.len(), c.inn.len()), (1, 2));

        // Indirect: head 2 points at a table of two descriptors at 0x4000.
        put(
            &mem,
            0,
            2,
            Descriptor::new(0x4000, 32, VRING_DESC_F_INDIRECT as u16, 0),
        );
        put(&mem, 0x4000, 0, Descriptor::new(0x1000, 16, n, 1));
        put(&mem, 0x4000, 1, Descriptor::new(0x3000, 1, w, 0));
        let c = walk_chain(&mem, GuestAddress(0), 8, 2).unwrap();
        assert_eq!((c.out.len(), c.inn.len()), (1, 1));

        // A loop: 4 -> 5 -> 4.
        put(&mem, 0, 4, Descriptor::new(0x1000, 16, n, 5));
        put(&mem, 0, 5, Descriptor::new(0x1000, 16, n, 4));
        assert!(walk_chain(&mem, GuestAddress(0), 8, 4)
            .unwrap_err()
            .what
            .contains("loops"));
        // Out of range.
        put(&mem, 0, 6, Descriptor::new(0x1000, 16, n, 9));
        assert!(walk_chain(&mem, GuestAddress(0), 8, 6).is_err());
    }
}
