//! What every filter over one child `file` passes straight through: [`passthrough`]
//! writes those `BlockDriver` methods, so a filter's module holds only what it changes.

/// The `BlockDriver` methods a filter over the child in field `$child` forwards as they
/// are: nothing of its own to reopen, flush, discard, block status and allocation depth,
/// the file name and allocation, its one child, and that it is a filter passing through.
macro_rules! passthrough {
    ($child:ident) => {
        fn reopen_rw(&self) -> BoxFut<'_, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }
        fn is_filter(&self) -> bool {
            true
        }
        fn flush(&self) -> BoxFut<'_, io::Result<()>> {
            self.$child.driver().flush()
        }
        fn discard(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<()>> {
            self.$child.driver_discard(offset, len)
        }
        fn block_status(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<BlockStatus>> {
            self.$child.driver().block_status(offset, len)
        }
        fn allocation_depth(&self, offset: u64, len: u64) -> BoxFut<'_, io::Result<(u64, u32)>> {
            self.$child.driver().allocation_depth(offset, len)
        }
        fn filename(&self) -> Option<String> {
            self.$child.filename()
        }
        fn no_flush(&self) -> bool {
            self.$child.driver().no_flush()
        }
        fn allocated_bytes(&self) -> Option<u64> {
            self.$child.allocated_bytes()
        }
        fn children(&self) -> Vec<(&'static str, Arc<BlockNode>)> {
            vec![("file", self.$child.clone())]
        }
        fn passes_through(&self) -> Option<(&Arc<BlockNode>, u64)> {
            Some((&self.$child, 0))
        }
    };
}

pub(crate) use passthrough;
