//! PBKDF2 (OpenSSL's), and how many iterations of it a second of this thread's CPU
//! time buys, measured as QEMU's qcrypto_pbkdf2_count_iters measures it.

use super::algs::HashAlg;
use super::CryptoError;

/// Derives `out` from `pass` and `salt`.
pub fn pbkdf2(
    hash: HashAlg,
    pass: &[u8],
    salt: &[u8],
    iterations: u64,
    out: &mut [u8],
) -> Result<(), CryptoError> {
    if iterations > i32::MAX as u64 {
        return Err(CryptoError::Invalid(format!(
            "PBKDF iterations {iterations} must be less than {}",
            i32::MAX
        )));
    }
    let md = hash.digest()?;
    openssl::pkcs5::pbkdf2_hmac(pass, salt, iterations as usize, md, out)
        .map_err(CryptoError::backend("Unable to derive the key"))
}

/// Iterations per second of CPU time for these inputs: from 2^15 up until one round
/// takes over half a second, then scaled to a second (QEMU's loop).
pub fn count_iters(
    hash: HashAlg,
    pass: &[u8],
    salt: &[u8],
    out_len: usize,
) -> Result<u64, CryptoError> {
    let mut out = zeroize::Zeroizing::new(vec![0u8; out_len]);
    let mut iterations: u64 = 1 << 15;
    loop {
        let start = crate::sys::thread_cpu_time();
        pbkdf2(hash, pass, salt, iterations, &mut out)?;
        let ms = (crate::sys::thread_cpu_time() - start).as_millis() as u64;
        if ms > 500 {
            return Ok(iterations * 1000 / ms);
        }
        iterations = match ms {
            0 => iterations * 2,
            1..100 => iterations * 10,
            _ => iterations * 1000 / ms,
        };
        if iterations > i32::MAX as u64 {
            // The clock did not move (or the hash is very fast): as many as fit.
            return Ok(i32::MAX as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc6070_vector() {
        let mut out = [0u8; 20];
        pbkdf2(HashAlg::Sha1, b"password", b"salt", 2, &mut out).unwrap();
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957");
        let e = pbkdf2(HashAlg::Sha1, b"p", b"s", 1 << 40, &mut out).unwrap_err();
        assert!(e.to_string().contains("must be less than"));
    }
}
