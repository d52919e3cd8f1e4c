//! `x-blockdev-amend` of a qcow2 image. QEMU amends only the keys of an image's LUKS
//! encryption this way (qcow2_co_amend), and stord opens no encrypted image: asked to
//! amend the encryption, the job fails with QEMU's words for an unencrypted image;
//! asked nothing, it succeeds having changed nothing, as QEMU's does.

use crate::block::driver_def::AmendDef;
use crate::schema::{opt, req, Arg, EnumType, Ty, UnionType};

/// QEMU's QCryptoBlockFormat.
static CRYPTO_FORMAT: EnumType = EnumType {
    name: "QCryptoBlockFormat",
    values: || vec!["qcow", "luks"],
};

/// QEMU's QCryptoBlockLUKSKeyslotState.
static KEYSLOT_STATE: EnumType = EnumType {
    name: "QCryptoBlockLUKSKeyslotState",
    values: || vec!["active", "inactive"],
};

/// QEMU's QCryptoBlockAmendOptionsLUKS.
const LUKS: &[Arg] = &[
    req("state", Ty::Enum(&KEYSLOT_STATE)),
    opt("new-secret", Ty::Str),
    opt("old-secret", Ty::Str),
    opt("keyslot", Ty::Int),
    opt("iter-time", Ty::Int),
    opt("secret", Ty::Str),
];

/// QEMU's QCryptoBlockAmendOptions.
static CRYPTO_AMEND: UnionType = UnionType {
    name: "QCryptoBlockAmendOptions",
    tag: "format",
    tag_type: &CRYPTO_FORMAT,
    variants: || vec![("luks", LUKS)],
};

pub static AMEND: AmendDef = AmendDef {
    args: &[opt("encrypt", Ty::Union(&CRYPTO_AMEND))],
    run: |_, options| {
        if options.contains_key("encrypt") {
            return Err("image is not encrypted, can't amend".into());
        }
        Ok(())
    },
};
