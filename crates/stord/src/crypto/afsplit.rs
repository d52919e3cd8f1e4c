//! The anti-forensic splitter of LUKS (QEMU's crypto/afsplit.c, the LUKS1 spec's AF
//! split): a key is spread over `stripes` blocks, all but the last random, so that
//! destroying any part of the stored material destroys the key.

use openssl::hash::{Hasher, MessageDigest};
use zeroize::Zeroizing;

use super::algs::HashAlg;
use super::CryptoError;

/// Hashes `block` in place in digest-sized pieces, each with its index before it.
fn diffuse(md: MessageDigest, block: &mut [u8]) -> Result<(), CryptoError> {
    let err = CryptoError::backend("Unable to hash the key material");
    let d = md.size();
    for (i, piece) in block.chunks_mut(d).enumerate() {
        let mut h = Hasher::new(md).map_err(err)?;
        h.update(&(i as u32).to_be_bytes()).map_err(err)?;
        h.update(piece).map_err(err)?;
        let out = h.finish().map_err(err)?;
        let n = piece.len();
        piece.copy_from_slice(&out[..n]);
    }
    Ok(())
}

fn xor_into(acc: &mut [u8], other: &[u8]) {
    acc.iter_mut().zip(other).for_each(|(a, b)| *a ^= b);
}

/// The running digest over the first `stripes - 1` blocks of `split`.
fn fold(md: MessageDigest, split: &[u8], len: usize) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    let mut block = Zeroizing::new(vec![0u8; len]);
    let stripes = split.len() / len;
    for stripe in split.chunks_exact(len).take(stripes - 1) {
        xor_into(&mut block, stripe);
        diffuse(md, &mut block)?;
    }
    Ok(block)
}

/// Splits `key` into `stripes` blocks of its length.
pub fn encode(
    hash: HashAlg,
    stripes: usize,
    key: &[u8],
) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    let len = key.len();
    let mut split = Zeroizing::new(vec![0u8; len * stripes]);
    super::random_bytes(&mut split[..len * (stripes - 1)])?;
    let block = fold(hash.digest()?, &split, len)?;
    let last = &mut split[len * (stripes - 1)..];
    last.copy_from_slice(key);
    xor_into(last, &block);
    Ok(split)
}

/// Joins `split` (`stripes` blocks) back into the key, `split.len() / stripes` long.
pub fn decode(
    hash: HashAlg,
    stripes: usize,
    split: &[u8],
) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    let len = split.len() / stripes;
    let mut key = fold(hash.digest()?, &split[..len * stripes], len)?;
    xor_into(&mut key, &split[len * (stripes - 1)..len * stripes]);
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keys_join_back_and_every_stripe_matters() {
        let key: Vec<u8> = (0..64u8).collect();
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            let split = encode(hash, 4000, &key).unwrap();
            assert_eq!(split.len(), 64 * 4000);
            assert_eq!(&decode(hash, 4000, &split).unwrap()[..], &key[..]);
            let mut damaged = split.clone();
            damaged[100] ^= 1;
            assert_ne!(&decode(hash, 4000, &damaged).unwrap()[..], &key[..]);
        }
    }

    #[test]
    fn the_digest_is_cut_for_the_last_piece() {
        // A 20-byte key under SHA-256: one piece, shorter than the digest.
        let key = [7u8; 20];
        let split = encode(HashAlg::Sha256, 3, &key).unwrap();
        assert_eq!(&decode(HashAlg::Sha256, 3, &split).unwrap()[..], &key[..]);
    }
}
