//! A user's hold on a node's permissions ([`Claim`]), and how a node takes, checks and
//! passes down what its users claim (QEMU's bdrv_child_try_set_perm and the
//! permission walk down the graph). The permission model itself is in [`super::perm`].

use std::sync::Arc;

use super::block_node::{BlockNode, Claim};
use super::perm::{Perm, PermError, Use, Users};

impl Claim {
    /// The node claimed.
    pub fn node(&self) -> &Arc<BlockNode> {
        &self.node
    }

    /// What this user takes and shares now.
    pub fn held(&self) -> (Perm, Perm) {
        self.node.use_of(self.id)
    }

    /// Changes what this user takes and shares (all or nothing).
    pub fn set(&self, perm: Perm, shared: Perm) -> Result<(), PermError> {
        self.node.update_use(self.id, perm, shared)
    }

    /// The same use (user, role, permissions) of node `to`, for a parent whose link
    /// moves there: taken while this one is still held, so a conflict leaves all as it was.
    pub fn transfer(&self, to: &Arc<BlockNode>) -> Result<Claim, PermError> {
        let (user, role, perm, shared) = {
            let users = self.node.users.lock().expect("node users");
            match users.list.iter().find(|u| u.id == self.id) {
                Some(u) => (u.user.clone(), u.role, u.perm, u.shared),
                None => return to.claim("", "root", Perm::NONE, Perm::ALL),
            }
        };
        to.claim(&user, role, perm, shared)
    }
}

impl BlockNode {
    /// Takes `perm` on this node for `user` (its `role` in messages), letting the other
    /// users hold `shared`; the node passes what it now needs down to its children.
    pub fn claim(
        self: &Arc<Self>,
        user: &str,
        role: &'static str,
        perm: Perm,
        shared: Perm,
    ) -> Result<Claim, PermError> {
        let shared = if self.force_share { Perm::ALL } else { shared };
        self.check_active(perm)?;
        let mut users = self.users.lock().expect("node users");
        if let Some(e) = users.conflict(&self.name, None, (user, role), perm, shared) {
            return Err(e);
        }
        let id = users.next_id;
        users.next_id += 1;
        users.list.push(Use {
            id,
            user: user.to_string(),
            role,
            perm,
            shared,
        });
        if let Err(e) = self.apply(&mut users) {
            users.list.retain(|u| u.id != id);
            let _ = self.apply(&mut users);
            return Err(e);
        }
        drop(users);
        Ok(Claim {
            node: self.clone(),
            id,
        })
    }

    fn update_use(&self, id: u64, perm: Perm, shared: Perm) -> Result<(), PermError> {
        let shared = if self.force_share { Perm::ALL } else { shared };
        self.check_active(perm)?;
        let mut users = self.users.lock().expect("node users");
        let Some(i) = users.list.iter().position(|u| u.id == id) else {
            return Ok(());
        };
        let me = (users.list[i].user.clone(), users.list[i].role);
        if let Some(e) = users.conflict(&self.name, Some(id), (&me.0, me.1), perm, shared) {
            return Err(e);
        }
        let old = (users.list[i].perm, users.list[i].shared);
        users.list[i].perm = perm;
        users.list[i].shared = shared;
        if let Err(e) = self.apply(&mut users) {
            users.list[i].perm = old.0;
            users.list[i].shared = old.1;
            let _ = self.apply(&mut users);
            return Err(e);
        }
        Ok(())
    }

    pub(super) fn release_use(&self, id: u64) {
        let mut users = self.users.lock().expect("node users");
        users.list.retain(|u| u.id != id);
        // Giving permissions back cannot conflict; a lock that cannot be dropped stays.
        let _ = self.apply(&mut users);
    }

    /// Makes the children's claims and the driver's locks follow the users' cumulative
    /// permissions.
    fn apply(&self, users: &mut Users<Claim>) -> Result<(), PermError> {
        let (perm, shared) = users.cumulative();
        let children = self.driver.children();
        if users.children.is_empty() && !children.is_empty() {
            for (role, child) in children {
                let (p, s) = self.child_claim(role, perm, shared);
                match child.claim(&self.name, role, p, s) {
                    Ok(c) => users.children.push(c),
                    Err(e) => {
                        users.children.clear();
                        return Err(e);
                    }
                }
            }
        } else {
            let mut done: Vec<(usize, (Perm, Perm))> = Vec::new();
            for (i, (role, _)) in children.into_iter().enumerate() {
                let (p, s) = self.child_claim(role, perm, shared);
                let c = &users.children[i];
                let before = c.node.use_of(c.id);
                if let Err(e) = c.set(p, s) {
                    // Back to what the children had.
                    for (j, (bp, bs)) in done {
                        let _ = users.children[j].set(bp, bs);
                    }
                    return Err(e);
                }
                done.push((i, before));
            }
        }
        if self.is_inactive() {
            // An inactive node holds nothing of its file (QEMU's file-posix takes no lock
            // for one): another process may own the image meanwhile.
            self.driver.set_perm(Perm::NONE, Perm::ALL)
        } else {
            self.driver.set_perm(perm, shared)
        }
    }

    /// An inactive node gives nobody write access (QEMU's words for the refusal).
    fn check_active(&self, perm: Perm) -> Result<(), PermError> {
        match (perm & (Perm::WRITE | Perm::RESIZE)).each().next() {
            Some((_, name)) if self.is_inactive() => Err(PermError::Locked(format!(
                "Permission '{name}' unavailable on inactive node"
            ))),
            _ => Ok(()),
        }
    }

    /// What the node takes of its child `role` for users holding `perm` and sharing
    /// `shared`: its driver's rule, writing only while the node is writable and active;
    /// an inactive node lets others write and resize (QEMU's default perms with
    /// BDRV_O_INACTIVE).
    fn child_claim(&self, role: &'static str, perm: Perm, shared: Perm) -> (Perm, Perm) {
        let writes = !self.is_read_only() && !self.is_inactive();
        let (p, s) = self.driver.child_perms(role, perm, shared, writes);
        if self.is_inactive() {
            (p, s | Perm::WRITE | Perm::RESIZE)
        } else {
            (p, s)
        }
    }

    /// Points this node's backing link at `new` (QEMU's bdrv_set_backing_hd): the node's
    /// claim moves from the old backing node to the new one, taken first, so a conflict
    /// leaves everything as it was. The old backing node is given back.
    pub fn set_backing(
        &self,
        new: Option<Arc<BlockNode>>,
    ) -> Result<Option<Arc<BlockNode>>, String> {
        let mut users = self.users.lock().expect("node users");
        let claimed = !users.children.is_empty();
        let claim = match (&new, claimed) {
            (Some(b), true) => {
                let (perm, shared) = users.cumulative();
                let (p, s) = self.child_claim("backing", perm, shared);
                Some(
                    b.claim(&self.name, "backing", p, s)
                        .map_err(|e| e.to_string())?,
                )
            }
            _ => None,
        };
        let old = self.driver.set_backing(new)?;
        if claimed {
            // The children's claims follow children()'s order: the file's, then the
            // backing node's.
            if let Some(old) = &old {
                users.children.retain(|c| !Arc::ptr_eq(c.node(), old));
            }
            users.children.extend(claim);
        }
        Ok(old)
    }

    /// What user `id` takes and shares now.
    fn use_of(&self, id: u64) -> (Perm, Perm) {
        let users = self.users.lock().expect("node users");
        users
            .list
            .iter()
            .find(|u| u.id == id)
            .map_or((Perm::NONE, Perm::ALL), |u| (u.perm, u.shared))
    }

    /// Takes what the node needs of its children before it has users (a format node
    /// writes its metadata whatever its users do): the error is QEMU's when another user
    /// or process is in the way.
    pub fn refresh_perms(&self) -> Result<(), PermError> {
        let mut users = self.users.lock().expect("node users");
        self.apply(&mut users)
    }

    /// Who uses the node: each user's name, role, permissions taken and shared, in the
    /// order they came (x-debug-query-block-graph's edges).
    pub fn users_now(&self) -> Vec<(String, &'static str, Perm, Perm)> {
        let users = self.users.lock().expect("node users");
        users
            .list
            .iter()
            .map(|u| (u.user.clone(), u.role, u.perm, u.shared))
            .collect()
    }

    /// The permissions the node's users hold together, and what they all share.
    pub fn cumulative_perms(&self) -> (Perm, Perm) {
        self.users.lock().expect("node users").cumulative()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::drivers::null::{test_node as null, NullDriver};

    #[test]
    fn users_that_do_not_share_conflict_with_qemus_message() {
        let n = null("disk");
        let w = n
            .claim(
                "export 'e1'",
                "root",
                Perm::WRITE | Perm::CONSISTENT_READ,
                Perm::CONSISTENT_READ,
            )
            .unwrap();
        let e = n
            .claim("export 'e2'", "root", Perm::WRITE, Perm::ALL)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Permission conflict on node 'disk': permissions 'write' are both required by \
             export 'e2' (uses node 'disk' as 'root' child) and unshared by export 'e1' \
             (uses node 'disk' as 'root' child)."
        );
        // A reader that lets others write gets in; one that forbids writes does not.
        let r = n
            .claim("reader", "root", Perm::CONSISTENT_READ, Perm::ALL)
            .unwrap();
        assert!(n
            .claim(
                "strict",
                "root",
                Perm::CONSISTENT_READ,
                Perm::CONSISTENT_READ
            )
            .is_err());
        assert_eq!(
            n.cumulative_perms(),
            (Perm::CONSISTENT_READ | Perm::WRITE, Perm::CONSISTENT_READ)
        );
        drop(w);
        drop(r);
        assert_eq!(n.cumulative_perms(), (Perm::NONE, Perm::ALL));
        let _w2 = n
            .claim("export 'e2'", "root", Perm::WRITE, Perm::ALL)
            .unwrap();
    }

    #[test]
    fn force_share_lets_everything_through() {
        let mut n = BlockNode::new(
            "ro".into(),
            Box::new(NullDriver::new(1 << 20, false)),
            true,
            false,
        );
        n.force_share = true;
        let n = Arc::new(n);
        let _a = n
            .claim("a", "root", Perm::CONSISTENT_READ, Perm::NONE)
            .unwrap();
        let _b = n
            .claim("b", "root", Perm::CONSISTENT_READ, Perm::NONE)
            .unwrap();
    }
}
