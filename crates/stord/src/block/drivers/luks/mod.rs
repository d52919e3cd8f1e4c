//! The `luks` format driver (QEMU's block/crypto.c): a LUKS1 volume over its child
//! `file`, its header there or on a node of its own (`header`), unlocked at open with the
//! `secret` object `key-secret` names. Requests are whole 512-byte sectors of the payload
//! encrypted by sector number ([`crate::crypto`]); a partial sector is read, decrypted,
//! patched and encrypted again under a lock on its sectors. Data is encrypted into a
//! buffer of ours, never in the caller's. `blockdev-create` is [`create`], key slot
//! changes (`x-blockdev-amend`) are [`amend`].

pub(crate) mod amend;
pub(crate) mod create;
mod driver;

use std::io;
use std::sync::Arc;

use crate::block::driver_def::DriverDef;
use crate::block::node::block_node::BlockNode;
use crate::block::open::{GraphError, Opened};
use crate::cli::Help;
use crate::crypto::luks::header::HEADER_LEN;
use crate::crypto::luks::{password_of, Luks};
use crate::crypto::CryptoError;
pub use driver::LuksDriver;

/// The driver table's entry.
pub const DRIVER: DriverDef = DriverDef {
    names: &["luks"],
    takes_discard: false,
    takes_cache: false,
    help: Help {
        synopsis: "file=<node> | file.driver=...,key-secret=<id>\n\
                   [,header=<node> | ,header.driver=...]",
        about: "a LUKS1 encrypted volume over its child `file`, unlocked\n\
                with the secret `key-secret` names; `header`: its header\n\
                on another node",
    },
    create: Some(&create::CREATE),
    amend: Some(&amend::AMEND),
    open: |g, kv, flags| {
        let file = g.child(kv, "file")?;
        let header = g.optional_child(kv, "header")?.flatten();
        let secret = kv.take("key-secret");
        let Some(id) = secret else {
            return Err(invalid("Parameter 'key-secret' is required for cipher"));
        };
        let Some(bytes) = g.secret(&id).map(zeroize::Zeroizing::new) else {
            return Err(invalid(&format!("No secret with id '{id}'")));
        };
        let password = password_of(&id, &bytes).map_err(crypto_err)?;
        let store = header.clone().unwrap_or_else(|| file.clone());
        // Read access while the header is read, as QEMU attaches children first.
        let (perm, shared) = crate::block::node::perm::storage_perms(false);
        let _opening = store.claim(flags.node_name, "file", perm, shared)?;
        let mut read = |offset: u64, buf: &mut [u8]| read_storage(&store, offset, buf);
        let mut bytes = [0u8; HEADER_LEN];
        read(0, &mut bytes).map_err(crypto_err)?;
        let luks = Luks::load(&bytes, header.is_some()).map_err(crypto_err)?;
        let key = luks.find_key(&password, &mut read).map_err(crypto_err)?;
        let cipher = luks.cipher(&key).map_err(crypto_err)?;
        Ok(Opened {
            read_only: flags.read_only || file.is_read_only(),
            direct: file.direct,
            driver: Box::new(LuksDriver::new((file, header), luks, id, cipher)),
            bitmaps: Vec::new(),
        })
    },
};

fn invalid(s: &str) -> GraphError {
    GraphError::Invalid(s.into())
}

fn crypto_err(e: CryptoError) -> GraphError {
    GraphError::Invalid(e.to_string())
}

/// Reads the header's storage from code off the loops (an open, an amendment): past the
/// node's end it reads zeroes, as QEMU's block layer does.
pub(crate) fn read_storage(
    node: &Arc<BlockNode>,
    offset: u64,
    buf: &mut [u8],
) -> Result<(), CryptoError> {
    let have = node.size().saturating_sub(offset).min(buf.len() as u64) as usize;
    buf[have..].fill(0);
    if have == 0 {
        return Ok(());
    }
    let n = node.clone();
    let read = crate::block::helper_thread::block_on_helper(move || async move {
        let (r, b) = n.read(offset, crate::buf::new_buf(have)).await;
        r.map(|()| b)
    })
    .and_then(|r| r);
    match read {
        Ok(b) => {
            buf[..have].copy_from_slice(&b);
            Ok(())
        }
        Err(e) => Err(header_io(&e, "read")),
    }
}

fn header_io(e: &io::Error, what: &str) -> CryptoError {
    CryptoError::Io(format!(
        "Could not {what} encryption header: {}",
        crate::sys::os_text(e)
    ))
}
