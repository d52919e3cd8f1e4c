//! Requests that change an open image's header: `block_resize` (the L1 table grown
//! first when it must cover more, then the data file's part, then the size field) and
//! changing the backing file (its name and format).

use std::io;
use std::sync::atomic::Ordering;

use super::driver::{MetaKind, Qcow2Driver};
use super::header;
use crate::block::node::block_node::BlockDriver;

impl Qcow2Driver {
    /// Grows the virtual size (L1 table first, if it must cover more, then the header's
    /// size field, each durable before the next). Shrinking is refused: stord does not
    /// yet drop the clusters past the new end.
    pub(super) async fn resize_impl(&self, new: u64) -> io::Result<()> {
        let mut m = self.meta.lock().await;
        self.check_not_corrupt()?;
        let old = self.size();
        if new < old {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "qcow2: shrinking an image is not supported",
            ));
        }
        if !new.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "The new size must be a multiple of 512",
            ));
        }
        let need = new.div_ceil(self.cluster_size << self.l2_bits) as usize;
        if need > m.l1.len() {
            self.grow_l1(&mut m, need).await?;
        }
        self.grow_data_file(&mut m, old, new).await?;
        self.file_write(header::field::SIZE, &new.to_be_bytes())
            .await?;
        self.file.driver().flush().await?;
        self.size.store(new, Ordering::Relaxed);
        Ok(())
    }

    pub(super) async fn change_backing_file_impl(
        &self,
        backing: Option<(&str, Option<&str>)>,
    ) -> io::Result<()> {
        self.refuse_backing(backing.is_some())?;
        let m = self.meta.lock().await;
        let c0 = self.file_read(0, self.cluster_size as usize).await?;
        let new = header::with_backing(&c0, backing)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        self.check_overlap(&m, 0, new.len() as u64, Some(MetaKind::Header))
            .await?;
        self.file_write(0, &new).await?;
        self.file.driver().flush().await?;
        drop(m);
        Ok(())
    }
}
