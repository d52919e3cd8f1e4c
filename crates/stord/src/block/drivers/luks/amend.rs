//! `x-blockdev-amend` of LUKS key slots (QEMU's QCryptoBlockAmendOptionsLUKS), for the
//! `luks` driver ([`AMEND`]) and for qcow2's `encrypt` ([`prepare`]): the secrets the
//! options name are looked up when the command runs, the key derivations run on a worker
//! thread ([`crate::crypto::luks::amend`]), and the writes it asks for go to the node that
//! holds the header, in its order, each partial sector read and patched first.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value};
use zeroize::Zeroizing;

pub(crate) use super::driver::Keys;
use super::LuksDriver;
use crate::block::create::{CreateEnv, Creation};
use crate::block::driver_def::AmendDef;
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::crypto::luks::amend::{amend, HeaderWrite, KeyslotChange};
use crate::crypto::luks::{password_of, Luks};
use crate::crypto::CryptoError;
use crate::schema::{opt, req, Arg, EnumType, Ty};

/// QEMU's QCryptoBlockLUKSKeyslotState.
pub(crate) static KEYSLOT_STATE: EnumType = EnumType {
    name: "QCryptoBlockLUKSKeyslotState",
    values: || vec!["active", "inactive"],
};

/// QEMU's QCryptoBlockAmendOptionsLUKS.
pub(crate) const LUKS_AMEND_ARGS: &[Arg] = &[
    req("state", Ty::Enum(&KEYSLOT_STATE)),
    opt("new-secret", Ty::Str),
    opt("old-secret", Ty::Str),
    opt("keyslot", Ty::Int),
    opt("iter-time", Ty::Int),
    opt("secret", Ty::Str),
];

/// The `luks` driver's part of `x-blockdev-amend` (QEMU's BlockdevAmendOptionsLUKS).
pub static AMEND: AmendDef = AmendDef {
    args: LUKS_AMEND_ARGS,
    prepare: |node, options, force, env| {
        let d = node
            .driver()
            .as_any()
            .and_then(|a| a.downcast_ref::<LuksDriver>())
            .ok_or("x-blockdev-amend doesn't support changing the block driver")?;
        let (storage, keys) = d.key_store();
        // QEMU's block_crypto_amend_prepare: write access to the header's node while the
        // keys change (refused here, as there, if it cannot be had).
        let claim = storage
            .claim(&node.name, "file", Perm::WRITE, Perm::ALL)
            .map_err(|e| e.to_string())?;
        let store = HeaderStore {
            node: storage,
            base: 0,
            limit: None,
            write_err: "Could not write encryption header",
        };
        let work = prepare(keys, store, change_of(options), force, env);
        Ok(Box::pin(async move {
            let r = work.await;
            drop(claim);
            r
        }))
    },
};

/// Where a header lies: on `node` from `base`, no further than `limit` bytes (qcow2's
/// extension says how far), and QEMU's text for a failed write there.
pub(crate) struct HeaderStore {
    pub node: Arc<BlockNode>,
    pub base: u64,
    pub limit: Option<u64>,
    pub write_err: &'static str,
}

/// QCryptoBlockAmendOptionsLUKS's members as the command gave them (checked already).
pub(crate) fn change_of(m: &Map<String, Value>) -> KeyslotChange {
    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
    KeyslotChange {
        active: m.get("state").and_then(Value::as_str) == Some("active"),
        new_secret: s("new-secret"),
        old_secret: s("old-secret"),
        keyslot: m.get("keyslot").and_then(Value::as_i64),
        iter_time: m.get("iter-time").and_then(Value::as_i64),
        secret: s("secret"),
    }
}

/// The amendment of the header in `store` by `change`, with the secrets it names looked
/// up now (the job fails on one that is missing, as QEMU's looks them up as it runs).
pub(crate) fn prepare(
    keys: Keys,
    store: HeaderStore,
    change: KeyslotChange,
    force: bool,
    env: &dyn CreateEnv,
) -> Creation {
    let mut secrets = BTreeMap::new();
    let unlocking = change.secret.clone().unwrap_or(keys.opened_with.clone());
    for id in [&change.new_secret, &change.old_secret, &Some(unlocking)]
        .into_iter()
        .flatten()
    {
        secrets.insert(id.clone(), env.secret(id).map(Zeroizing::new));
    }
    Box::pin(async move {
        let mut luks = keys.luks.lock().await;
        let area = read_area(&store, &luks).await?;
        let mut l = luks.clone();
        let opened_with = keys.opened_with;
        let writes = crate::block::worker_pool::run(move || {
            let lookup = |id: &str| match secrets.get(id) {
                Some(Some(bytes)) => password_of(id, bytes),
                _ => Err(CryptoError::Invalid(format!("No secret with id '{id}'"))),
            };
            let mut read = |off: u64, buf: &mut [u8]| {
                let at = off as usize;
                match area.get(at..at + buf.len()) {
                    Some(b) => {
                        buf.copy_from_slice(b);
                        Ok(())
                    }
                    None => Err(CryptoError::Io(
                        "Request for data outside of extension header".into(),
                    )),
                }
            };
            let w = amend(&mut l, &change, force, &opened_with, &lookup, &mut read);
            w.map(|w| (l, w))
        })
        .await;
        let (l, writes) = writes.map_err(|e| e.to_string())?;
        // As QEMU, the header in memory is the new one once the writes start.
        *luks = l;
        for w in writes {
            let (offset, bytes) = match w {
                HeaderWrite::Bytes(off, b) => (off, b),
                HeaderWrite::Random(off, len) => {
                    let mut b = Zeroizing::new(vec![0u8; len]);
                    crate::crypto::random_bytes(&mut b).map_err(|e| e.to_string())?;
                    (off, b)
                }
            };
            store.write(offset, &bytes).await?;
        }
        store.node.flush().await.map_err(|e| store.io_err(&e))
    })
}

/// The header and every slot's key material, as stored.
async fn read_area(store: &HeaderStore, luks: &Luks) -> Result<Vec<u8>, String> {
    let end = (0..crate::crypto::luks::header::NUM_KEY_SLOTS)
        .map(|i| {
            let (off, len) = luks.material(i);
            off + len as u64
        })
        .max()
        .unwrap_or(0);
    // No further than the node (or qcow2's extension) reaches: a detached header's slots
    // may say they lie anywhere.
    let room = store.node.size().saturating_sub(store.base);
    let len = (end.div_ceil(512) * 512).min(room);
    let len = store.limit.map_or(len, |l| len.min(l));
    let (r, b) = store
        .node
        .read(store.base, crate::buf::request_buf(len as usize))
        .await;
    r.map_err(|e| {
        format!(
            "Could not read encryption header: {}",
            crate::sys::os_text(&e)
        )
    })?;
    Ok(b.to_vec())
}

impl HeaderStore {
    fn io_err(&self, e: &std::io::Error) -> String {
        format!("{}: {}", self.write_err, crate::sys::os_text(e))
    }

    /// Writes `bytes` at `offset` of the header, the sectors it covers only in part read
    /// and patched first.
    async fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        if self.limit.is_some_and(|l| offset + bytes.len() as u64 > l) {
            return Err("Request for data outside of extension header".into());
        }
        let at = self.base + offset;
        let start = at / 512 * 512;
        let end = (at + bytes.len() as u64).div_ceil(512) * 512;
        let mut buf = crate::buf::request_buf((end - start) as usize);
        if start != at || end != at + bytes.len() as u64 {
            let (r, b) = self.node.read(start, buf).await;
            r.map_err(|e| self.io_err(&e))?;
            buf = b;
        }
        let skip = (at - start) as usize;
        buf[skip..skip + bytes.len()].copy_from_slice(bytes);
        let (r, mut buf) = self.node.write(start, buf, false).await;
        zeroize::Zeroize::zeroize(&mut buf[..]);
        r.map_err(|e| self.io_err(&e))
    }
}
