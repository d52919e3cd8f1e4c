//! Debug events: the named steps of a driver's work (QEMU's BlkdebugEvent) that a format
//! driver announces on its file child before it takes them (an L1 entry written, a cluster
//! allocated, data read), so that a `blkdebug` node there can change its state or arm the
//! errors its rules name. A node whose driver takes no events hands them to the child a
//! filter passes through to, as QEMU's bdrv_debug_event walks down; where none takes
//! them they cost a call.

/// One step, as QEMU names it (qapi's BlkdebugEvent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DebugEvent {
    L1Update,
    L1GrowAllocTable,
    L1GrowWriteTable,
    L1GrowActivateTable,
    L2Load,
    L2Update,
    L2UpdateCompressed,
    L2AllocCowRead,
    L2AllocWrite,
    ReadAio,
    ReadBackingAio,
    ReadCompressed,
    WriteAio,
    WriteCompressed,
    VmstateLoad,
    VmstateSave,
    CowRead,
    CowWrite,
    ReftableLoad,
    ReftableGrow,
    ReftableUpdate,
    RefblockLoad,
    RefblockUpdate,
    RefblockUpdatePart,
    RefblockAlloc,
    RefblockAllocHookup,
    RefblockAllocWrite,
    RefblockAllocWriteBlocks,
    RefblockAllocWriteTable,
    RefblockAllocSwitchTable,
    ClusterAlloc,
    ClusterAllocBytes,
    ClusterFree,
    FlushToOs,
    FlushToDisk,
    PwritevRmwHead,
    PwritevRmwAfterHead,
    PwritevRmwTail,
    PwritevRmwAfterTail,
    Pwritev,
    PwritevZero,
    PwritevDone,
    EmptyImagePrepare,
    L1ShrinkWriteTable,
    L1ShrinkFreeL2Clusters,
    CorWrite,
    ClusterAllocSpace,
    /// QEMU's `none`: raised once, as the blkdebug node opens.
    Nothing,
}

use DebugEvent::*;

/// Every event with QEMU's name, in the schema's order.
pub const EVENTS: &[(DebugEvent, &str)] = &[
    (L1Update, "l1_update"),
    (L1GrowAllocTable, "l1_grow_alloc_table"),
    (L1GrowWriteTable, "l1_grow_write_table"),
    (L1GrowActivateTable, "l1_grow_activate_table"),
    (L2Load, "l2_load"),
    (L2Update, "l2_update"),
    (L2UpdateCompressed, "l2_update_compressed"),
    (L2AllocCowRead, "l2_alloc_cow_read"),
    (L2AllocWrite, "l2_alloc_write"),
    (ReadAio, "read_aio"),
    (ReadBackingAio, "read_backing_aio"),
    (ReadCompressed, "read_compressed"),
    (WriteAio, "write_aio"),
    (WriteCompressed, "write_compressed"),
    (VmstateLoad, "vmstate_load"),
    (VmstateSave, "vmstate_save"),
    (CowRead, "cow_read"),
    (CowWrite, "cow_write"),
    (ReftableLoad, "reftable_load"),
    (ReftableGrow, "reftable_grow"),
    (ReftableUpdate, "reftable_update"),
    (RefblockLoad, "refblock_load"),
    (RefblockUpdate, "refblock_update"),
    (RefblockUpdatePart, "refblock_update_part"),
    (RefblockAlloc, "refblock_alloc"),
    (RefblockAllocHookup, "refblock_alloc_hookup"),
    (RefblockAllocWrite, "refblock_alloc_write"),
    (RefblockAllocWriteBlocks, "refblock_alloc_write_blocks"),
    (RefblockAllocWriteTable, "refblock_alloc_write_table"),
    (RefblockAllocSwitchTable, "refblock_alloc_switch_table"),
    (ClusterAlloc, "cluster_alloc"),
    (ClusterAllocBytes, "cluster_alloc_bytes"),
    (ClusterFree, "cluster_free"),
    (FlushToOs, "flush_to_os"),
    (FlushToDisk, "flush_to_disk"),
    (PwritevRmwHead, "pwritev_rmw_head"),
    (PwritevRmwAfterHead, "pwritev_rmw_after_head"),
    (PwritevRmwTail, "pwritev_rmw_tail"),
    (PwritevRmwAfterTail, "pwritev_rmw_after_tail"),
    (Pwritev, "pwritev"),
    (PwritevZero, "pwritev_zero"),
    (PwritevDone, "pwritev_done"),
    (EmptyImagePrepare, "empty_image_prepare"),
    (L1ShrinkWriteTable, "l1_shrink_write_table"),
    (L1ShrinkFreeL2Clusters, "l1_shrink_free_l2_clusters"),
    (CorWrite, "cor_write"),
    (ClusterAllocSpace, "cluster_alloc_space"),
    (Nothing, "none"),
];

impl DebugEvent {
    /// QEMU's name.
    pub fn name(self) -> &'static str {
        EVENTS.iter().find(|e| e.0 == self).map_or("none", |e| e.1)
    }

    /// The event QEMU names `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        EVENTS.iter().find(|e| e.1 == name).map(|e| e.0)
    }
}

/// QAPI's `BlkdebugEvent`, for the schema.
pub fn event_names() -> Vec<&'static str> {
    EVENTS.iter().map(|e| e.1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for &(e, n) in EVENTS {
            assert_eq!(DebugEvent::from_name(n), Some(e));
            assert_eq!(e.name(), n);
            assert!(seen.insert(n), "{n} twice");
        }
        assert_eq!(EVENTS.len(), 48);
        assert_eq!(DebugEvent::from_name("l3_update"), Option::None);
    }
}
