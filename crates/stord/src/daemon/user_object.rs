//! [`UserObject`]: the `--object` types that are data, held in the daemon's state by id.

use std::sync::Arc;

use crate::secret::Secret;
use crate::tls::authz::AuthzSimple;
use crate::tls::creds::TlsCreds;

/// An object that is data, not a thread or a group: credentials, an authorization list, a
/// secret.
pub enum UserObject {
    TlsCreds(Arc<TlsCreds>),
    Authz(Arc<AuthzSimple>),
    Secret(Secret),
}

impl UserObject {
    /// Its `qom-type`.
    pub(super) fn type_name(&self) -> &'static str {
        match self {
            UserObject::TlsCreds(c) => match **c {
                TlsCreds::X509(_) => "tls-creds-x509",
                TlsCreds::Psk(_) => "tls-creds-psk",
            },
            UserObject::Authz(_) => "authz-simple",
            UserObject::Secret(_) => "secret",
        }
    }

    /// Whether something (the NBD server) holds it.
    pub(super) fn in_use(&self) -> bool {
        match self {
            UserObject::TlsCreds(c) => Arc::strong_count(c) > 1,
            UserObject::Authz(a) => Arc::strong_count(a) > 1,
            UserObject::Secret(_) => false,
        }
    }
}
