//! `x-blockdev-amend` of a qcow2 image. QEMU amends only the key slots of an image's LUKS
//! encryption this way (qcow2_co_amend): they change in the LUKS header inside the image
//! as they do in a `luks` volume's ([`crate::block::drivers::luks::amend`]); an image
//! without encryption fails the job with QEMU's words, and asked nothing, the job
//! succeeds having changed nothing, as QEMU's does.

use crate::block::create::failing;
use crate::block::driver_def::AmendDef;
use crate::block::drivers::luks::amend::{change_of, prepare, HeaderStore, LUKS_AMEND_ARGS};
use crate::schema::{opt, EnumType, Ty, UnionType};

use super::Qcow2Driver;

/// QEMU's QCryptoBlockFormat.
static CRYPTO_FORMAT: EnumType = EnumType {
    name: "QCryptoBlockFormat",
    values: || vec!["qcow", "luks"],
};

/// QEMU's QCryptoBlockAmendOptions.
static CRYPTO_AMEND: UnionType = UnionType {
    name: "QCryptoBlockAmendOptions",
    tag: "format",
    tag_type: &CRYPTO_FORMAT,
    variants: || vec![("luks", LUKS_AMEND_ARGS)],
};

pub static AMEND: AmendDef = AmendDef {
    args: &[opt("encrypt", Ty::Union(&CRYPTO_AMEND))],
    prepare: |node, options, force, env| {
        let Some(encrypt) = options.get("encrypt").and_then(|e| e.as_object()) else {
            return Ok(Box::pin(async { Ok(()) }));
        };
        let d = node
            .driver()
            .as_any()
            .and_then(|a| a.downcast_ref::<Qcow2Driver>())
            .ok_or("x-blockdev-amend doesn't support changing the block driver")?;
        let Some(c) = &d.crypt else {
            return Ok(failing("image is not encrypted, can't amend".into()));
        };
        if encrypt.get("format").and_then(|f| f.as_str()) != Some("luks") {
            return Ok(failing(
                "Amend can't be used to change the qcow2 encryption format".into(),
            ));
        }
        // QEMU writes through the file child it holds for writing (and asserts that it
        // does); a read-only image is refused instead.
        if node.is_read_only() {
            return Err(format!("Node '{}' is read only", node.name));
        }
        let store = HeaderStore {
            node: d.file.clone(),
            base: c.header.0,
            limit: Some(c.header.1),
            // QEMU's qcow2_crypto_hdr_write_func says "read".
            write_err: "Could not read encryption header",
        };
        Ok(prepare(
            c.keys.clone(),
            store,
            change_of(encrypt),
            force,
            env,
        ))
    },
};
