//! The TLS layer's one error type: credentials that could not be loaded, a session that
//! could not be set up or failed.

use std::path::PathBuf;

use crate::cli::keyval::OptionError;

/// Why TLS credentials could not be loaded or a session could not be set up: the TLS
/// layer's error.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("{what}: unable to read '{}': {source}", path.display())]
    Read {
        what: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: '{}': {detail}", path.display())]
    BadFile {
        what: String,
        path: PathBuf,
        detail: String,
    },
    #[error("{what}: {detail}")]
    Unsupported { what: String, detail: String },
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("TLS: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
    #[error("TLS handshake: {0}")]
    Handshake(String),
    /// Our own certificate does not chain to the CA (QEMU's sanity check, its words).
    #[error("{0}")]
    Sanity(String),
}
