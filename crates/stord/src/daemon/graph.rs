//! The graph builder: `--blockdev` / `blockdev-add` open a node and, first, its inline
//! children, through the driver table ([`crate::block::drivers::BLOCK_DRIVERS`]).
//!
//! A build is all or nothing: every node the builder adds is recorded, and if any step
//! fails (an option, a lock, an image) they are taken out again, newest first, before the
//! error returns, so a refused `blockdev-add` leaves the graph and the image locks as they
//! were. Inline children get a generated name (`#block000`, ...) and go when their parent
//! goes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::close::close_now;
use super::error::DaemonError;
use super::state::State;
use crate::block::drivers;
use crate::block::node::block_node::BlockNode;
use crate::block::node::options::{CommonOptions, DetectZeroes};
use crate::block::open::{Graph, GraphError, OpenFlags};
use crate::block::throttle_group::ThrottleGroup;
use crate::cli::id_wellformed;
use crate::cli::keyval::KeyVal;

/// How deep a chain of backing files may go (a loop ends here too).
const MAX_BACKING_DEPTH: u32 = 64;

/// One build: the state it adds to and what it has added.
struct Builder<'a> {
    st: &'a mut State,
    /// Nodes added by this build, oldest first.
    added: Vec<String>,
    /// What inline children of the node being opened inherit (one entry per node being
    /// opened, innermost last).
    inherit: Vec<Vec<(&'static str, String)>>,
    /// Backing files being opened, one inside the other.
    backing_depth: u32,
}

impl State {
    /// `--blockdev` / `blockdev-add`: the node and its inline children, or nothing.
    pub fn add_blockdev(&mut self, kv: KeyVal) -> Result<(), DaemonError> {
        let mut b = Builder {
            st: self,
            added: Vec::new(),
            inherit: Vec::new(),
            backing_depth: 0,
        };
        match b.open_node(kv, false) {
            Ok(_) => Ok(()),
            Err(e) => {
                b.roll_back();
                Err(e.into())
            }
        }
    }

    /// A node opened by a command other than blockdev-add (blockdev-snapshot-sync's
    /// overlay): as in QEMU the monitor does not own it (it goes once nothing uses it),
    /// and without a `node-name` it gets a `#blockNNN` one. Its name back.
    pub(super) fn add_blockdev_unowned(&mut self, kv: KeyVal) -> Result<String, DaemonError> {
        let implicit = true;
        let mut b = Builder {
            st: self,
            added: Vec::new(),
            inherit: Vec::new(),
            backing_depth: 0,
        };
        match b.open_node(kv, implicit) {
            Ok(n) => Ok(n.name.clone()),
            Err(e) => {
                b.roll_back();
                Err(e.into())
            }
        }
    }

    /// Takes a node that nothing uses out of the graph again, with its implicit children.
    pub(super) fn forget_node(&mut self, name: &str) {
        if let Some(node) = self.nodes.remove(name) {
            self.implicit.remove(name);
            let children = node
                .children()
                .iter()
                .map(|(_, c)| c.name.clone())
                .collect();
            drop(node);
            self.drop_implicit(children);
        }
    }

    /// A fresh name for an inline child, as qsd's `#blockNNN`.
    fn implicit_name(&mut self) -> String {
        loop {
            let n = format!("#block{:03}", self.implicit_seq);
            self.implicit_seq += 1;
            if !self.nodes.contains_key(&n) {
                return n;
            }
        }
    }
}

impl Builder<'_> {
    /// Takes out what this build added, newest first (a parent before its children, so
    /// each drops its references before its children go).
    fn roll_back(&mut self) {
        while let Some(name) = self.added.pop() {
            if let Some(node) = self.st.nodes.remove(&name) {
                // Bitmaps marked in use when the node went into service go back to the
                // image as they were.
                if node.has_persistent_bitmaps() {
                    close_now(&node);
                }
            }
            self.st.implicit.remove(&name);
        }
    }

    fn open_node(&mut self, mut kv: KeyVal, implicit: bool) -> Result<Arc<BlockNode>, GraphError> {
        let driver_name = kv.take_required("driver")?;
        let name = match kv.take("node-name") {
            Some(n) => n,
            None if implicit => self.st.implicit_name(),
            None => return Err(kv.missing("node-name").into()),
        };
        if !name.starts_with('#') || !implicit {
            check_node_name(&name)?;
        }
        if self.st.nodes.contains_key(&name) {
            return Err(GraphError::DuplicateNode(name));
        }
        let Some(def) = drivers::driver(&driver_name) else {
            return Err(kv
                .bad_value("driver", &drivers::driver_names(), &driver_name)
                .into());
        };
        let read_only = kv.take_bool("read-only", false)?;
        let _ = kv.take_bool("auto-read-only", false)?;
        let inactive = !kv.take_bool("active", true)?;
        let common = common_options(&mut kv, def.takes_discard, read_only)?;
        // What inline children inherit, as QEMU's do: the cache mode, read-only,
        // force-share, and discard=unmap (a child passes on what its parent decided to
        // discard).
        let mut inherit = vec![("discard", "unmap".to_string())];
        if !def.takes_cache {
            for key in ["cache.direct", "cache.no-flush"] {
                if let Some(v) = kv.take(key) {
                    inherit.push((key, v));
                }
            }
        }
        if read_only {
            inherit.push(("read-only", "on".into()));
        }
        if common.force_share {
            inherit.push(("force-share", "on".into()));
        }
        if inactive {
            inherit.push(("active", "off".into()));
        }
        self.inherit.push(inherit);
        let opened = (def.open)(
            self,
            &mut kv,
            OpenFlags {
                read_only,
                node_name: &name,
                inactive,
            },
        );
        self.inherit.pop();
        let opened = opened?;
        let what = kv.what.clone();
        kv.finish()?;
        let node = Arc::new(
            BlockNode::new(name.clone(), opened.driver, opened.read_only, opened.direct)
                .with_options(common),
        );
        node.adopt_bitmaps(opened.bitmaps);
        node.set_inactive(inactive);
        // What the node needs of its children (a format node: its file), as locks where
        // they are files: refused here if another user or process is in the way.
        node.refresh_perms()?;
        if node.has_persistent_bitmaps() && !inactive {
            let n = node.clone();
            crate::block::helper_thread::block_on_helper(move || async move { n.activate().await })
                .and_then(|r| r)
                .map_err(|e| GraphError::Invalid(format!("{what}: {e}")))?;
        }
        self.register(name, &node, implicit);
        Ok(node)
    }

    /// Puts an opened node in the table, its events going where the daemon's go.
    fn register(&mut self, name: String, node: &Arc<BlockNode>, implicit: bool) {
        if let Some(p) = self.st.events.poster() {
            node.set_event_poster(p);
        }
        self.st.nodes.insert(name.clone(), node.clone());
        self.added.push(name.clone());
        if implicit {
            self.st.implicit.insert(name);
        }
    }

    /// `role.driver=...` opened inline, with what the parent passes on.
    fn open_inline(&mut self, mut inline: KeyVal) -> Result<Arc<BlockNode>, GraphError> {
        if let Some(inherit) = self.inherit.last() {
            for (k, v) in inherit {
                inline.inherit(k, v);
            }
        }
        self.open_node(inline, true)
    }

    fn named(&self, name: &str) -> Result<Arc<BlockNode>, GraphError> {
        self.st
            .nodes
            .get(name)
            .cloned()
            .ok_or_else(|| GraphError::ChildNotFound(name.into()))
    }
}

impl Graph for Builder<'_> {
    fn child(&mut self, kv: &mut KeyVal, role: &str) -> Result<Arc<BlockNode>, GraphError> {
        if let Some(inline) = kv.take_prefixed(role) {
            if kv.take(role).is_some() {
                return Err(GraphError::Invalid(format!(
                    "{}: '{role}' given both as a node name and inline",
                    kv.what
                )));
            }
            return self.open_inline(inline);
        }
        let name = kv.take_required(role)?;
        self.named(&name)
    }

    fn optional_child(
        &mut self,
        kv: &mut KeyVal,
        role: &str,
    ) -> Result<Option<Option<Arc<BlockNode>>>, GraphError> {
        if let Some(inline) = kv.take_prefixed(role) {
            return Ok(Some(Some(self.open_inline(inline)?)));
        }
        match kv.take(role).as_deref() {
            None => Ok(None),
            Some("null" | "") => Ok(Some(None)),
            Some(name) => Ok(Some(Some(self.named(name)?))),
        }
    }

    fn backing_file(
        &mut self,
        image: &BlockNode,
        name: &str,
        format: Option<String>,
    ) -> Result<Arc<BlockNode>, GraphError> {
        let path = if name.starts_with('/') {
            PathBuf::from(name)
        } else {
            let Some(dir) = image
                .filename()
                .and_then(|f| Path::new(&f).parent().map(Path::to_path_buf))
            else {
                return Err(GraphError::Invalid(format!(
                    "Cannot use relative backing file name '{name}' for an image without a file name"
                )));
            };
            dir.join(name)
        };
        if self.backing_depth >= MAX_BACKING_DEPTH {
            return Err(GraphError::Invalid(format!(
                "Backing chain too deep (or a loop) at '{}'",
                path.display()
            )));
        }
        let format = match format {
            Some(f) => f,
            None => {
                // No backing_fmt: probe, as QEMU does (qcow2 by its magic, else raw).
                let mut magic = [0u8; 4];
                let is_qcow2 = std::fs::File::open(&path)
                    .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                    .is_ok()
                    && crate::block::drivers::qcow2::has_magic(&magic);
                if is_qcow2 { "qcow2" } else { "raw" }.to_string()
            }
        };
        let mut pairs = vec![
            ("driver".to_string(), format),
            ("read-only".into(), "on".into()),
            ("file.driver".into(), "file".into()),
            ("file.filename".into(), path.display().to_string()),
        ];
        if image.direct {
            pairs.push(("file.cache.direct".into(), "on".into()));
        }
        let kv = KeyVal::from_pairs(&format!("backing file '{}'", path.display()), pairs);
        // A backing file inherits nothing from the image's options but what it is given.
        self.inherit.push(Vec::new());
        self.backing_depth += 1;
        let r = self.open_node(kv, true);
        self.backing_depth -= 1;
        self.inherit.pop();
        r
    }

    fn data_file(&mut self, name: &str) -> Result<Arc<BlockNode>, GraphError> {
        // QEMU's bdrv_find_protocol without protocol prefixes: a device by what it is,
        // anything else a file.
        let device = std::fs::metadata(name).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_block_device() || m.file_type().is_char_device()
        });
        let driver = if device { "host_device" } else { "file" };
        let pairs = [
            ("driver".to_string(), driver.to_string()),
            ("filename".to_string(), name.to_string()),
        ];
        self.open_inline(KeyVal::from_pairs(&format!("data file '{name}'"), pairs))
    }

    fn throttle_group(&self, id: &str) -> Option<Arc<ThrottleGroup>> {
        self.st.throttle_groups.get(id).cloned()
    }

    fn secret(&self, id: &str) -> Option<Vec<u8>> {
        self.st.secret(id)
    }

    fn client_tls_creds(&self, id: &str) -> Result<Arc<crate::tls::creds::TlsCreds>, String> {
        self.st.client_tls_creds(id)
    }
}

/// QEMU's rules for a node name (`id_wellformed`, and 31 bytes at most) and its messages.
pub(super) fn check_node_name(name: &str) -> Result<(), GraphError> {
    if !id_wellformed(name) {
        return Err(GraphError::Invalid(format!("Invalid node-name: '{name}'")));
    }
    if name.len() > 31 {
        return Err(GraphError::Invalid("Node name too long".into()));
    }
    Ok(())
}

/// The options every node takes ([`CommonOptions`]), with QEMU's rules and messages.
/// `discard` is only looked at here for drivers that do not take it themselves.
fn common_options(
    kv: &mut KeyVal,
    driver_takes_discard: bool,
    read_only: bool,
) -> Result<CommonOptions, GraphError> {
    let detect_zeroes = match kv
        .take_choice("detect-zeroes", &["off", "on", "unmap"])?
        .as_deref()
    {
        Some("on") => DetectZeroes::On,
        Some("unmap") => DetectZeroes::Unmap,
        _ => DetectZeroes::Off,
    };
    const DISCARD: &[&str] = &["ignore", "off", "unmap", "on"];
    let discard = if driver_takes_discard {
        let v = kv.get("discard").map(str::to_string);
        if let Some(v) = &v {
            if !DISCARD.contains(&v.as_str()) {
                return Err(kv.bad_value("discard", "'ignore' or 'unmap'", v).into());
            }
        }
        v
    } else {
        kv.take_choice("discard", DISCARD)?
    };
    let unmap = matches!(discard.as_deref(), Some("unmap" | "on"));
    if detect_zeroes == DetectZeroes::Unmap && !unmap {
        return Err(GraphError::Invalid(
            "setting detect-zeroes to unmap is not allowed without setting discard operation to unmap"
                .into(),
        ));
    }
    let force_share = kv.take_bool("force-share", false)?;
    if force_share && !read_only {
        return Err(GraphError::Invalid(
            "force-share=on can only be used with read-only images".into(),
        ));
    }
    Ok(CommonOptions {
        detect_zeroes,
        unmap,
        force_share,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::id_wellformed;

    /// The graph's rules, as typed errors (QMP and the command line show their texts).
    #[test]
    fn node_names_follow_qemus_rules() {
        for ok in ["a", "disk0", "drive-efidisk0", "x.y_z-1", &"n".repeat(31)] {
            assert!(check_node_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "0abc", "-x", "a b", "a/b", "#block1", "é"] {
            let e = check_node_name(bad).unwrap_err().to_string();
            assert_eq!(e, format!("Invalid node-name: '{bad}'"));
        }
        let e = check_node_name(&"n".repeat(32)).unwrap_err().to_string();
        assert_eq!(e, "Node name too long");
        assert!(id_wellformed("io0") && !id_wellformed("0io") && !id_wellformed("a,b"));
    }
}
