//! `blockdev-create` of an encrypted image (QEMU's qcow2_set_up_encryption): `encrypt`
//! (QEMU's QCryptoBlockCreateOptions) read and its secret looked up while the command runs,
//! then, in the job, a LUKS volume made with QEMU's defaults for the header that goes into
//! the image's clusters after its L1 table, as QEMU places it.

use crate::block::create::{unsupported, CreateEnv};
use crate::block::drivers::luks::create::options as luks_options;
use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;
use crate::crypto::luks::create::{create, CreateOptions, Created};
use crate::crypto::luks::password_of;

/// What `encrypt` asks for, with its secret as looked up.
pub(super) struct EncryptCreate {
    options: CreateOptions,
    /// `key-secret`: the id, and the secret's bytes if there is one.
    secret: Option<(String, Option<zeroize::Zeroizing<Vec<u8>>>)>,
}

/// Takes `encrypt.*` (None without it): its `format` is the union's tag, which QEMU's
/// schema requires; `qcow` (legacy AES) is not made.
pub(super) fn take_options(
    kv: &mut KeyVal,
    env: &dyn CreateEnv,
) -> Result<Option<EncryptCreate>, GraphError> {
    if kv.take("encrypt").is_some() {
        return Err(GraphError::Invalid(
            "Invalid parameter type for 'encrypt', expected: object".into(),
        ));
    }
    let Some(mut e) = kv.take_prefixed("encrypt") else {
        return Ok(None);
    };
    match e.take_choice("format", &["qcow", "luks"])?.as_deref() {
        Some("luks") => {}
        Some(_) => return Err(unsupported("encrypt.format=qcow")),
        None => return Err(kv.missing("encrypt.format").into()),
    }
    let id = e.take("key-secret");
    let options = luks_options(&mut e)?;
    e.finish()?;
    Ok(Some(EncryptCreate {
        options,
        secret: id.map(|id| {
            let bytes = env.secret(&id).map(zeroize::Zeroizing::new);
            (id, bytes)
        }),
    }))
}

impl EncryptCreate {
    /// The new volume (its key derivations timed on a worker thread), or QEMU's error.
    pub(super) async fn make(self) -> Result<Created, String> {
        let Some((id, bytes)) = self.secret else {
            return Err("Parameter 'encrypt.key-secret' is required for cipher".into());
        };
        let bytes = bytes.ok_or_else(|| format!("No secret with id '{id}'"))?;
        let password = password_of(&id, &bytes).map_err(|e| e.to_string())?;
        let o = self.options;
        crate::block::worker_pool::run(move || create(&o, &password, false))
            .await
            .map_err(|e| e.to_string())
    }
}
