//! `blockdev-create` of `driver=luks` (QEMU's block_crypto_co_create_luks): the header
//! and slot 0 written on `file`, payload after it, or on `header` alone (a detached
//! header, payload at 0 of `file` if given).

use std::sync::Arc;

use crate::block::create::{
    resize_allocated, unsupported, CreateDef, CreateEnv, Creation, Prealloc, PREALLOC_MODE,
};
use crate::block::node::block_node::BlockNode;
use crate::block::node::perm::Perm;
use crate::block::open::GraphError;
use crate::cli::keyval::KeyVal;
use crate::crypto::algs::{cipher_names, CipherAlg, CipherMode, HashAlg, IvGenAlg};
use crate::crypto::luks::create::{create, CreateOptions, Created};
use crate::crypto::luks::password_of;
use crate::schema::{opt, req, EnumType, Ty};

static CIPHER_ALG: EnumType = EnumType {
    name: "QCryptoCipherAlgo",
    values: cipher_names,
};
static CIPHER_MODE: EnumType = EnumType {
    name: "QCryptoCipherMode",
    values: || CipherMode::NAMES.to_vec(),
};
static IVGEN_ALG: EnumType = EnumType {
    name: "QCryptoIVGenAlgo",
    values: || IvGenAlg::NAMES.to_vec(),
};
static HASH_ALG: EnumType = EnumType {
    name: "QCryptoHashAlgo",
    values: HashAlg::names,
};

/// `blockdev-create`'s part for `driver=luks` (QEMU's BlockdevCreateOptionsLUKS).
pub const CREATE: CreateDef = CreateDef {
    args: &[
        opt("key-secret", Ty::Str),
        opt("cipher-alg", Ty::Enum(&CIPHER_ALG)),
        opt("cipher-mode", Ty::Enum(&CIPHER_MODE)),
        opt("ivgen-alg", Ty::Enum(&IVGEN_ALG)),
        opt("ivgen-hash-alg", Ty::Enum(&HASH_ALG)),
        opt("hash-alg", Ty::Enum(&HASH_ALG)),
        opt("iter-time", Ty::Int),
        opt("file", Ty::Any),
        opt("header", Ty::Any),
        req("size", Ty::Uint),
        opt("preallocation", Ty::Enum(&PREALLOC_MODE)),
    ],
    prepare,
};

/// The options, checked as the schema's enums were.
pub(crate) fn options(kv: &mut KeyVal) -> Result<CreateOptions, GraphError> {
    let d = CreateOptions::default();
    let iter_time = kv.take_u64("iter-time", false)?;
    Ok(CreateOptions {
        cipher_alg: kv
            .take("cipher-alg")
            .and_then(|n| CipherAlg::from_name(&n))
            .unwrap_or(d.cipher_alg),
        cipher_mode: kv
            .take("cipher-mode")
            .and_then(|n| CipherMode::from_name(&n))
            .unwrap_or(d.cipher_mode),
        ivgen_alg: kv
            .take("ivgen-alg")
            .and_then(|n| IvGenAlg::from_name(&n))
            .unwrap_or(d.ivgen_alg),
        ivgen_hash_alg: kv
            .take("ivgen-hash-alg")
            .and_then(|n| HashAlg::from_name(&n)),
        hash_alg: kv
            .take("hash-alg")
            .and_then(|n| HashAlg::from_name(&n))
            .unwrap_or(d.hash_alg),
        iter_time_ms: iter_time.unwrap_or(d.iter_time_ms),
    })
}

fn prepare(mut kv: KeyVal, env: &dyn CreateEnv) -> Result<Creation, GraphError> {
    let inline = |kv: &mut KeyVal, k: &str| kv.take_prefixed(k).is_some();
    if inline(&mut kv, "file.") || inline(&mut kv, "header.") {
        return Err(unsupported("an inline 'file' or 'header' (name a node)"));
    }
    let file = kv.take("file");
    let header = kv.take("header");
    // `metadata` is `off` for a volume, which has none (QEMU passes it to the file, whose
    // truncate takes it as no preallocation).
    let prealloc = match Prealloc::take(&mut kv)? {
        Prealloc::Metadata => Prealloc::Off,
        p => p,
    };
    let secret_id = kv.take("key-secret");
    let o = options(&mut kv)?;
    let size = kv.take_u64("size", false)?.unwrap_or(0);
    kv.finish()?;
    let job = Job {
        file: file.map(|n| (env.node(&n), n)),
        header: header.map(|n| (env.node(&n), n)),
        secret: secret_id.map(|id| (env.secret(&id).map(zeroize::Zeroizing::new), id)),
        prealloc,
        size,
        o,
    };
    Ok(Box::pin(job.run()))
}

type Named<T> = Option<(Option<T>, String)>;

/// The creation, with what was looked up while the graph was at hand.
struct Job {
    file: Named<Arc<BlockNode>>,
    header: Named<Arc<BlockNode>>,
    secret: Named<zeroize::Zeroizing<Vec<u8>>>,
    prealloc: Prealloc,
    size: u64,
    o: CreateOptions,
}

fn found<T>(n: Named<T>) -> Result<Option<T>, String> {
    match n {
        None => Ok(None),
        Some((Some(v), _)) => Ok(Some(v)),
        Some((None, name)) => Err(format!(
            "Cannot find device='{name}' nor node-name='{name}'"
        )),
    }
}

impl Job {
    async fn run(self) -> Result<(), String> {
        if self.header.is_none() && self.file.is_none() {
            return Err("Either the parameter 'header' or 'file' must be specified".into());
        }
        if self.prealloc != Prealloc::Off && self.file.is_none() {
            return Err(
                "Parameter 'preallocation' requires 'file' to be specified for \
                        formatting LUKS disk"
                    .into(),
            );
        }
        let header = found(self.header)?;
        let file = found(self.file)?;
        let Some((bytes, id)) = self.secret else {
            return Err("Parameter 'key-secret' is required for cipher".into());
        };
        let bytes = bytes.ok_or_else(|| format!("No secret with id '{id}'"))?;
        let password = password_of(&id, &bytes).map_err(|e| e.to_string())?;
        let (o, detached) = (self.o, header.is_some());
        let created = crate::block::worker_pool::run(move || create(&o, &password, detached))
            .await
            .map_err(|e| e.to_string())?;
        let (size, prealloc) = (self.size, self.prealloc);
        match (header, file) {
            (Some(h), file) => {
                write_volume(&h, &created, 0, Prealloc::Off).await?;
                if let Some(f) = file {
                    let _claim = claim(&f)?;
                    resize(&f, size, prealloc).await?;
                }
                Ok(())
            }
            (None, Some(f)) => write_volume(&f, &created, size, prealloc).await,
            (None, None) => unreachable!("checked above"),
        }
    }
}

fn claim(node: &Arc<BlockNode>) -> Result<crate::block::node::block_node::Claim, String> {
    node.claim(
        "blockdev-create",
        "file",
        Perm::WRITE | Perm::RESIZE,
        Perm::ALL & Perm::RESIZE.complement(),
    )
    .map_err(|e| e.to_string())
}

async fn resize(node: &Arc<BlockNode>, size: u64, prealloc: Prealloc) -> Result<(), String> {
    resize_allocated(node, size, prealloc)
        .await
        .map_err(|e| format!("Could not resize image: {}", crate::sys::os_text(&e)))
}

/// Sizes `node` for the header and `size` bytes of payload, then writes slot 0's
/// material and the header (in that order, as QEMU stores a key).
async fn write_volume(
    node: &Arc<BlockNode>,
    c: &Created,
    size: u64,
    prealloc: Prealloc,
) -> Result<(), String> {
    let _claim = claim(node)?;
    resize(node, c.header_size + size, prealloc).await?;
    let (offset, _) = c.luks.material(0);
    write(node, offset, &c.material).await?;
    write(node, 0, &c.luks.header.encode()).await?;
    node.flush().await.map_err(|e| {
        format!(
            "Could not write encryption header: {}",
            crate::sys::os_text(&e)
        )
    })
}

/// Writes `bytes` at `offset`, the last sector padded with zeroes.
async fn write(node: &Arc<BlockNode>, offset: u64, bytes: &[u8]) -> Result<(), String> {
    let mut buf = crate::buf::new_buf(bytes.len().div_ceil(512) * 512);
    buf[..bytes.len()].copy_from_slice(bytes);
    let r = node.write(offset, buf, false).await.0;
    r.map_err(|e| {
        format!(
            "Could not write encryption header: {}",
            crate::sys::os_text(&e)
        )
    })
}
