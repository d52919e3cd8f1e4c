//! TLS for NBD: the credentials objects (`tls-creds-x509`, `tls-creds-psk`, with
//! `endpoint=server` for stord's NBD server and `endpoint=client` for the `nbd` block
//! driver), the `authz-simple` check, and the sessions a connection drives over its own
//! socket.
//!
//! A session is sans-I/O ([`session::TlsSession`]): the connection feeds it the ciphertext it
//! received and takes from it the ciphertext to send, so the NBD negotiation and
//! transmission keep their own socket code (io_uring receives, direct writev) and add only
//! a decrypt and an encrypt step. Certificates are checked by rustls (webpki), never by us;
//! pre-shared keys, which rustls does not implement, by OpenSSL. Objects and files follow
//! qemu-storage-daemon's: the same property names, the same file names in `dir`.

pub mod authz;
pub mod blocking;
pub mod creds;
pub mod error;
pub mod psk;
pub mod session;
pub mod x509;

use std::sync::Arc;

use authz::AuthzSimple;
use creds::TlsCreds;

/// What an NBD server with `tls-creds` (and maybe `tls-authz`) requires of clients.
pub struct TlsServer {
    pub creds_id: String,
    pub creds: Arc<TlsCreds>,
    pub authz: Option<(String, Arc<AuthzSimple>)>,
}
