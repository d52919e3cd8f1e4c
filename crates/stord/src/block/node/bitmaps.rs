//! A node's dirty bitmaps: the list it carries, the marks a write leaves in it (and in the
//! nodes below that a filter passes the write to), and `block-dirty-bitmap-add`/`-remove`
//! with QEMU's checks.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::block_node::BlockNode;
use super::dirty_bitmap;

impl BlockNode {
    /// Marks [offset, offset + len) in every recording bitmap (after the write, whatever
    /// its outcome, as QEMU's write_req_finish), here and in the nodes below that a filter
    /// passes the write to (a discard only as far down as the nodes pass discards on).
    pub(super) fn mark_dirty(&self, offset: u64, len: u64) {
        self.mark_dirty_as(offset, len, false)
    }

    pub(super) fn mark_dirty_as(&self, offset: u64, len: u64, discard: bool) {
        // A node that drops discards passes none on (QEMU checks each node's flag).
        if !dirty_bitmap::any_exist() || (discard && !self.unmap) {
            return;
        }
        if self.has_bitmaps.load(Relaxed) {
            for b in self
                .bitmaps
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
            {
                b.mark(offset, len);
            }
        }
        if let Some((child, shift)) = self.driver.passes_through() {
            child.mark_dirty_as(offset + shift, len, discard);
        }
    }

    /// The bitmaps, newest first (as QEMU lists them); jobs' trackers are not among them.
    pub fn bitmaps(&self) -> Vec<Arc<dirty_bitmap::DirtyBitmap>> {
        let mut v: Vec<_> = self
            .bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|b| !b.is_internal())
            .cloned()
            .collect();
        v.reverse();
        v
    }

    /// Starts a job's record of the writes to this node (see
    /// [`dirty_bitmap::DirtyBitmap::tracker`]); [`Self::forget_bitmap`] ends it.
    pub fn add_tracker(&self, b: dirty_bitmap::DirtyBitmap) -> Arc<dirty_bitmap::DirtyBitmap> {
        let b = Arc::new(b);
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.push(b.clone());
        self.has_bitmaps.store(true, Relaxed);
        b
    }

    /// The bitmap `name`.
    pub fn bitmap(
        &self,
        name: &str,
    ) -> Result<Arc<dirty_bitmap::DirtyBitmap>, dirty_bitmap::BitmapError> {
        self.bitmaps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|b| b.name == name && !b.is_internal())
            .cloned()
            .ok_or_else(|| dirty_bitmap::BitmapError::NotFound(name.into()))
    }

    /// Adds a bitmap (its name must be new on this node).
    pub fn add_bitmap(
        &self,
        b: dirty_bitmap::DirtyBitmap,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|x| x.name == b.name && !x.is_internal()) {
            return Err(dirty_bitmap::BitmapError::Exists(b.name.clone()));
        }
        if list.iter().filter(|x| !x.is_internal()).count() >= dirty_bitmap::MAX_PER_NODE {
            return Err(dirty_bitmap::BitmapError::TooMany);
        }
        list.push(Arc::new(b));
        self.has_bitmaps.store(true, Relaxed);
        Ok(())
    }

    /// Carries the persistent bitmaps its image holds (at open; no limit on their count:
    /// they are the image's).
    pub fn adopt_bitmaps(&self, loaded: Vec<dirty_bitmap::DirtyBitmap>) {
        if loaded.is_empty() {
            return;
        }
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.extend(loaded.into_iter().map(Arc::new));
        self.has_bitmaps.store(true, Relaxed);
    }

    /// `block-dirty-bitmap-add`: a new bitmap, stored in the image at close when
    /// `persistent` (QEMU's checks and texts, in its order).
    pub fn new_bitmap(
        &self,
        name: &str,
        granularity: Option<u64>,
        persistent: bool,
        disabled: bool,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        use dirty_bitmap::BitmapError;
        if name.is_empty() {
            return Err(BitmapError::EmptyName);
        }
        let granularity = match granularity {
            Some(g) if g < 512 || !g.is_power_of_two() => return Err(BitmapError::BadGranularity),
            Some(g) => g,
            None => self.default_bitmap_granularity(),
        };
        if persistent {
            if self.bitmap(name).is_ok() {
                return Err(BitmapError::Exists(name.into()));
            }
            let why = match self.driver.can_store_bitmap(granularity, name) {
                None => {
                    return Err(BitmapError::CannotStore(format!(
                        "Can't store persistent bitmaps to {}: Operation not supported",
                        self.name
                    )))
                }
                Some(Ok(())) => self.stored_bitmaps_fit(name),
                Some(Err(e)) => Err(e),
            };
            if let Err(e) = why {
                return Err(BitmapError::CannotStore(format!(
                    "Can't make bitmap '{name}' persistent in '{}': {e}",
                    self.name
                )));
            }
        }
        let b = dirty_bitmap::DirtyBitmap::new(name, granularity, self.size(), !disabled)?;
        b.set_persistent(persistent);
        self.add_bitmap(b)
    }

    /// Whether one more persistent bitmap fits the image's directory (QEMU's counts).
    fn stored_bitmaps_fit(&self, name: &str) -> Result<(), String> {
        let list = self.bitmaps();
        let stored: Vec<&str> = list
            .iter()
            .filter(|b| b.is_persistent())
            .map(|b| b.name.as_str())
            .chain([name])
            .collect();
        if stored.len() > 65535 {
            return Err("Maximum number of persistent bitmaps is already reached".into());
        }
        let dir: u64 = stored
            .iter()
            .map(|n| (24 + n.len() as u64).div_ceil(8) * 8)
            .sum();
        if dir > 64 << 20 {
            return Err("Not enough space in the bitmap directory".into());
        }
        Ok(())
    }

    /// `block-dirty-bitmap-remove`: a persistent bitmap leaves the image at once (its
    /// directory rewritten), as in QEMU.
    pub async fn remove_bitmap(&self, name: &str) -> Result<(), dirty_bitmap::BitmapError> {
        let b = self.bitmap(name)?;
        b.check(dirty_bitmap::Use::Remove)?;
        self.unstore_bitmap(&b).await?;
        self.forget_bitmap(&b);
        Ok(())
    }

    /// Takes a persistent bitmap out of the image (it stays on the node: stored again at
    /// close if it is not forgotten by then).
    pub async fn unstore_bitmap(
        &self,
        b: &dirty_bitmap::DirtyBitmap,
    ) -> Result<(), dirty_bitmap::BitmapError> {
        let name = b.name.as_str();
        if b.is_persistent() {
            self.driver.remove_stored_bitmap(name).await.map_err(|e| {
                dirty_bitmap::BitmapError::Io(format!("Failed to update bitmap extension: {e}"))
            })?;
        }
        Ok(())
    }

    /// Drops a bitmap from the node.
    pub fn forget_bitmap(&self, b: &Arc<dirty_bitmap::DirtyBitmap>) {
        let mut list = self.bitmaps.write().unwrap_or_else(|e| e.into_inner());
        list.retain(|x| !Arc::ptr_eq(x, b));
        self.has_bitmaps.store(!list.is_empty(), Relaxed);
    }

    /// Whether the node carries bitmaps its image stores.
    pub fn has_persistent_bitmaps(&self) -> bool {
        self.has_bitmaps.load(Relaxed) && self.bitmaps().iter().any(|b| b.is_persistent())
    }

    /// The granularity a new bitmap gets by default: the image's cluster size within
    /// 4 KiB to 64 KiB, else 64 KiB (QEMU's bdrv_get_default_bitmap_granularity).
    pub fn default_bitmap_granularity(&self) -> u64 {
        self.driver
            .cluster_size()
            .map_or(65536, |cs| cs.clamp(4096, 65536))
    }
}
