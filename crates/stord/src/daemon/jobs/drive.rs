//! drive-backup and drive-mirror, the older forms of blockdev-backup and blockdev-mirror
//! that older managers still send: the target is a file name, created in the source's
//! format unless `mode=existing` (QEMU's bdrv_img_create, backed as QEMU backs it for
//! `sync=top` and `sync=none`) and opened as a node the monitor does not own, which goes
//! once the job is over and nothing else uses it (a mirror's target that took the
//! exports stays). QEMU's checks in its order and words (blockdev.c's
//! drive_backup_action and qmp_drive_mirror).
//!
//! Where QEMU opens the target's backing file a second time, stord links the target to
//! the node that already has that image open: the content is the same, and an image is
//! not opened twice by one process.

use std::cell::RefCell;
use std::rc::Weak;
use std::sync::Arc;

use super::backup::{BackupOptions, PreparedBackup};
use super::mirror::MirrorOptions;
use crate::block::node::block_node::BlockNode;
use crate::cli::keyval::KeyVal;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::new_image::{create_image, probe_format};
use crate::daemon::state::State;

/// What drive-backup and drive-mirror add to their blockdev forms.
pub struct DriveTarget {
    /// The image's file name.
    pub path: String,
    /// Its format (else the source's, or probed with `mode=existing`).
    pub format: Option<String>,
    /// `mode=existing`: the image is there already.
    pub existing: bool,
    /// The node name to give it (drive-mirror's `node-name`).
    pub node_name: Option<String>,
}

/// The backing node below `n` past its filters (QEMU's bdrv_cow_bs(bdrv_skip_filters())).
fn cow_below(n: &Arc<BlockNode>) -> Option<Arc<BlockNode>> {
    let children = n.children();
    if let Some((_, b)) = children.iter().find(|(r, _)| *r == "backing") {
        return Some(b.clone());
    }
    match n.filtered_or_backing() {
        Some(f) => cow_below(&f),
        None => None,
    }
}

/// How the target is linked below: `Some(node)` to that node, `None` as its header says
/// (or to nothing when it names nothing).
type Below = Option<Arc<BlockNode>>;

impl State {
    /// Creates (unless it exists) and opens a drive-* target: its node's name.
    fn open_drive_target(
        &mut self,
        t: &DriveTarget,
        source: &Arc<BlockNode>,
        header_backing: Option<&Arc<BlockNode>>,
        below: Below,
    ) -> Result<String, DaemonError> {
        let format = match &t.format {
            Some(f) => f.clone(),
            None if t.existing => probe_format(&t.path)?.to_string(),
            None => source.driver_name().to_string(),
        };
        if !t.existing {
            let backing = header_backing.map(|b| {
                (
                    b.filename().unwrap_or_default(),
                    b.driver_name().to_string(),
                )
            });
            create_image(&t.path, &format, source.size(), backing)?;
        }
        let mut pairs = vec![
            ("driver".to_string(), format.clone()),
            ("file.driver".to_string(), "file".to_string()),
            ("file.filename".to_string(), t.path.clone()),
        ];
        if let Some(n) = &t.node_name {
            pairs.push(("node-name".to_string(), n.clone()));
        }
        if format == "qcow2" {
            if let Some(b) = below {
                pairs.push(("backing".to_string(), b.name.clone()));
            }
        }
        self.add_blockdev_unowned(KeyVal::from_pairs("drive", pairs))
    }

    /// A closure that lets node `name` go once nothing uses it.
    fn let_go(me: Weak<RefCell<State>>, name: String) -> Box<dyn FnOnce()> {
        Box::new(move || {
            if let Some(s) = me.upgrade() {
                if let Ok(mut st) = s.try_borrow_mut() {
                    st.drop_implicit(vec![name]);
                }
            }
        })
    }

    /// `drive-backup` up to the start (see [`State::blockdev_backup`]).
    pub fn drive_backup(
        &mut self,
        mut o: BackupOptions,
        t: DriveTarget,
        me: Weak<RefCell<State>>,
    ) -> Result<PreparedBackup, DaemonError> {
        let source = self.device_node(&o.device)?;
        source.check_not_busy()?;
        let mut header_backing = None;
        if o.sync == "top" {
            header_backing = cow_below(&source);
            if header_backing.is_none() {
                o.sync = "full".into();
            }
        }
        if o.sync == "none" {
            header_backing = Some(source.clone());
        }
        // QEMU opens a sync=top target's backing file from its header and links a
        // sync=none target to the source; an existing image keeps what its header says.
        let below = match (&header_backing, t.existing) {
            (Some(b), false) => Some(b.clone()),
            (Some(_), true) if o.sync == "none" => Some(source.clone()),
            _ => None,
        };
        let name = self.open_drive_target(&t, &source, header_backing.as_ref(), below)?;
        o.target = name.clone();
        match self.blockdev_backup(o) {
            Ok(mut p) => {
                p.after.0 = Some(Self::let_go(me, name));
                Ok(p)
            }
            Err(e) => {
                self.forget_node(&name);
                Err(e)
            }
        }
    }

    /// `drive-mirror`.
    pub fn drive_mirror(
        &mut self,
        mut o: MirrorOptions,
        t: DriveTarget,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        let source = self.root_node(&o.device)?;
        source.check_not_busy()?;
        let mut target_backing = cow_below(&source);
        if target_backing.is_none() && o.sync == "top" {
            o.sync = "full".into();
        }
        if o.sync == "none" {
            target_backing = Some(source.clone());
        }
        if o.replaces.is_some() && t.node_name.is_none() {
            return Err(invalid(
                "a node-name must be provided when replacing a named node of the graph",
            ));
        }
        let header = match &target_backing {
            Some(b) if o.sync != "full" => Some(b.clone()),
            _ => None,
        };
        // The backing link QEMU gives the target when the job completes: the source's
        // chain (or the header's, for an existing image).
        let below = if t.existing { None } else { header.clone() };
        let name = self.open_drive_target(&t, &source, header.as_ref(), below)?;
        o.target = name.clone();
        o.target_fresh = !t.existing;
        let after = Self::let_go(me.clone(), name.clone());
        self.mirror_then(o, me, Some(after)).inspect_err(|_| {
            self.forget_node(&name);
        })
    }
}
