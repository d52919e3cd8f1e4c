//! Node permissions, as QEMU's `BdrvChild` has them: every user of a node (an export, a
//! parent node, later a job) takes a set of permissions on it and says which permissions it
//! lets the others hold. A node's cumulative permissions (what its users take, and what
//! all of them share) decide what it takes from its own children, down to the file nodes,
//! which make them visible to other processes as QEMU's image locks (see
//! [`crate::block::drivers::file::lock`]). So QEMU's tools and stord see each other's use of an image,
//! and two users inside stord that cannot coexist are refused with QEMU's message.
//!
//! A user holds a [`Claim`]; dropping it gives the permissions back.

use std::fmt;

/// A set of permissions (QEMU's `BLK_PERM_*` bits, the same values).
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Perm(u8);

impl Perm {
    /// Nothing.
    pub const NONE: Perm = Perm(0);
    /// Reads return what the node holds (a format node needs it of its file).
    pub const CONSISTENT_READ: Perm = Perm(0x1);
    /// Writes that change the content.
    pub const WRITE: Perm = Perm(0x2);
    /// Writes that leave the content as it reads (a copy-on-read, a filter's write-back).
    pub const WRITE_UNCHANGED: Perm = Perm(0x4);
    /// Changing the size.
    pub const RESIZE: Perm = Perm(0x8);
    /// Every permission.
    pub const ALL: Perm = Perm(0xf);

    /// The bits, in order, with QEMU's names (which its error messages use).
    pub const NAMED: [(Perm, &'static str); 4] = [
        (Perm::CONSISTENT_READ, "consistent read"),
        (Perm::WRITE, "write"),
        (Perm::WRITE_UNCHANGED, "write unchanged"),
        (Perm::RESIZE, "resize"),
    ];

    /// QAPI's BlockPermission names of the bits, highest first as QEMU lists them.
    pub fn qapi_names(self) -> Vec<&'static str> {
        [
            (Perm::RESIZE, "resize"),
            (Perm::WRITE_UNCHANGED, "write-unchanged"),
            (Perm::WRITE, "write"),
            (Perm::CONSISTENT_READ, "consistent-read"),
        ]
        .into_iter()
        .filter(|(p, _)| self.contains(*p))
        .map(|(_, n)| n)
        .collect()
    }

    /// The raw bits.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// Whether every permission of `other` is in `self`.
    pub fn contains(self, other: Perm) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any permission of `other` is in `self`.
    pub fn intersects(self, other: Perm) -> bool {
        self.0 & other.0 != 0
    }

    /// The permissions not in `self`.
    pub fn complement(self) -> Perm {
        Perm(!self.0 & Perm::ALL.0)
    }

    /// Each bit of `self` by itself, with its name.
    pub fn each(self) -> impl Iterator<Item = (Perm, &'static str)> {
        Perm::NAMED
            .into_iter()
            .filter(move |(p, _)| self.contains(*p))
    }
}

impl std::ops::BitOr for Perm {
    type Output = Perm;
    fn bitor(self, o: Perm) -> Perm {
        Perm(self.0 | o.0)
    }
}

impl std::ops::BitAnd for Perm {
    type Output = Perm;
    fn bitand(self, o: Perm) -> Perm {
        Perm(self.0 & o.0)
    }
}

impl fmt::Debug for Perm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.each().map(|(_, n)| n).collect();
        write!(f, "[{}]", names.join(", "))
    }
}

/// Why a permission could not be taken.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PermError {
    /// Another user of the node in this daemon does not share it (QEMU's text, naming
    /// the users as stord knows them).
    #[error(
        "Permission conflict on node '{node}': permissions '{perm}' are both required by \
         {wants} (uses node '{node}' as '{wants_role}' child) and unshared by {denies} \
         (uses node '{node}' as '{denies_role}' child)."
    )]
    Conflict {
        node: String,
        perm: &'static str,
        wants: String,
        wants_role: &'static str,
        denies: String,
        denies_role: &'static str,
    },
    /// Another process holds the image (QEMU's text, from the file's locks).
    #[error("{0}")]
    Locked(String),
}

/// What one user takes and shares.
#[derive(Debug, Clone)]
pub(crate) struct Use {
    pub(super) id: u64,
    pub(super) user: String,
    pub(super) role: &'static str,
    pub(super) perm: Perm,
    pub(super) shared: Perm,
}

/// The users of one node (behind the node's mutex), and the node's own claims `C` on its
/// children.
#[derive(Debug)]
pub(crate) struct Users<C> {
    pub(super) next_id: u64,
    pub(super) list: Vec<Use>,
    /// The node's own claims on its children, made once it has users to serve (or at
    /// open, for what a format node needs of its file whatever its users want).
    pub(super) children: Vec<C>,
}

impl<C> Default for Users<C> {
    fn default() -> Self {
        Self {
            next_id: 0,
            list: Vec::new(),
            children: Vec::new(),
        }
    }
}

impl<C> Users<C> {
    /// What all users take, and what all of them share.
    pub(crate) fn cumulative(&self) -> (Perm, Perm) {
        self.list.iter().fold((Perm::NONE, Perm::ALL), |(p, s), u| {
            (p | u.perm, s & u.shared)
        })
    }

    /// The first conflict between `user` taking `perm` and sharing `shared`, and every
    /// user but `except`.
    pub(super) fn conflict(
        &self,
        node: &str,
        except: Option<u64>,
        me: (&str, &'static str),
        perm: Perm,
        shared: Perm,
    ) -> Option<PermError> {
        for u in self.list.iter().filter(|u| Some(u.id) != except) {
            let them = (u.user.as_str(), u.role);
            // What we want that they do not let others have, then what they hold that we
            // do not let them keep.
            let clash = (perm & u.shared.complement())
                .each()
                .next()
                .map(|(_, n)| (n, me, them))
                .or_else(|| {
                    (u.perm & shared.complement())
                        .each()
                        .next()
                        .map(|(_, n)| (n, them, me))
                });
            if let Some((perm, wants, denies)) = clash {
                return Some(PermError::Conflict {
                    node: node.to_string(),
                    perm,
                    wants: wants.0.to_string(),
                    wants_role: wants.1,
                    denies: denies.0.to_string(),
                    denies_role: denies.1,
                });
            }
        }
        None
    }
}

/// What a format node takes of the child that stores its data and metadata (QEMU's
/// `bdrv_default_perms_for_storage`): consistent reads always, write and resize when the
/// node is writable, whatever its users want; it lets others read and write unchanged
/// data but not change it or its size under the metadata it caches.
pub fn storage_perms(writable: bool) -> (Perm, Perm) {
    let perm = if writable {
        Perm::CONSISTENT_READ | Perm::WRITE | Perm::RESIZE
    } else {
        Perm::CONSISTENT_READ
    };
    (perm, Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED)
}

/// What an image takes of the child that stores only its data (qcow2's `data-file`; QEMU's
/// `bdrv_default_perms_for_storage` for a data child): what its users take and share, but
/// nobody else resizes it, writing includes resizing (writes may go past its end), and an
/// unchanged write is a write (a copy-on-read still writes there).
pub fn data_perms(perm: Perm, shared: Perm) -> (Perm, Perm) {
    let mut p = perm;
    if p.contains(Perm::WRITE_UNCHANGED) {
        p = p | Perm::WRITE;
    }
    if p.contains(Perm::WRITE) {
        p = p | Perm::RESIZE;
    }
    (p, shared & Perm::RESIZE.complement())
}

/// What an image takes of its backing node (QEMU's `bdrv_default_perms_for_cow`): reads if
/// its users read; others may write there only if every user of the image allows writes.
pub fn backing_perms(perm: Perm, shared: Perm) -> (Perm, Perm) {
    let mut s = Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED;
    if shared.contains(Perm::WRITE) {
        s = s | Perm::WRITE | Perm::RESIZE;
    }
    (perm & Perm::CONSISTENT_READ, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemus_storage_and_cow_rules() {
        let (p, s) = storage_perms(true);
        assert!(
            p.contains(Perm::WRITE | Perm::RESIZE) && !s.intersects(Perm::WRITE | Perm::RESIZE)
        );
        let (p, _) = storage_perms(false);
        assert_eq!(p, Perm::CONSISTENT_READ);
        let (p, s) = backing_perms(Perm::ALL, Perm::CONSISTENT_READ);
        assert_eq!(p, Perm::CONSISTENT_READ);
        assert!(!s.intersects(Perm::WRITE));
        assert!(backing_perms(Perm::NONE, Perm::ALL).1.contains(Perm::WRITE));
        // A data child: the users' own, writing with resizing, resizing unshared.
        assert_eq!(
            data_perms(Perm::NONE, Perm::ALL),
            (Perm::NONE, Perm::ALL & Perm::RESIZE.complement())
        );
        let (p, s) = data_perms(Perm::CONSISTENT_READ | Perm::WRITE_UNCHANGED, Perm::ALL);
        assert_eq!(p, Perm::ALL);
        assert!(!s.contains(Perm::RESIZE));
    }
}
