//! The daemon's NBD server: `nbd-server-start` and `nbd-server-stop`, and stopping any
//! protocol server with the exports it offers.

use std::sync::Arc;

use stord_aio::AioContext;

use crate::export::nbd::options::NbdServerOpts;
use crate::export::nbd::server::NbdServer;
use crate::tls::TlsServer;

use super::error::DaemonError;
use super::state::State;
use super::user_object::UserObject;

impl State {
    /// `--nbd-server` / `nbd-server-start`.
    pub fn start_nbd_server(
        &mut self,
        ctx: &AioContext,
        opts: NbdServerOpts,
    ) -> Result<(), DaemonError> {
        if self.servers.contains_key("nbd") {
            return Err(DaemonError::NbdServerRunning);
        }
        let tls = match &opts.tls_creds {
            None => None,
            Some(id) => {
                let Some(UserObject::TlsCreds(creds)) = self.objects.get(id) else {
                    return Err(DaemonError::NoTlsCreds(id.clone()));
                };
                if creds.is_client() {
                    return Err(DaemonError::Invalid(
                        "Expected TLS credentials for a server endpoint".into(),
                    ));
                }
                let authz = match &opts.tls_authz {
                    None => None,
                    Some(a) => match self.objects.get(a) {
                        Some(UserObject::Authz(z)) => Some((a.clone(), z.clone())),
                        _ => return Err(DaemonError::NoAuthz(a.clone())),
                    },
                };
                Some(Arc::new(TlsServer {
                    creds_id: id.clone(),
                    creds: creds.clone(),
                    authz,
                }))
            }
        };
        if opts.tls_authz.is_some() && tls.is_none() {
            return Err(DaemonError::Invalid(
                "tls-authz is only useful together with tls-creds".into(),
            ));
        }
        let addr = opts.addr.clone();
        let server = NbdServer::start(ctx, opts, tls).map_err(|source| DaemonError::Listen {
            addr: addr.to_string(),
            source,
        })?;
        self.servers.insert("nbd", Box::new(server));
        Ok(())
    }

    /// Whether the NBD server listens.
    pub fn nbd_server_running(&self) -> bool {
        self.servers.contains_key("nbd")
    }

    /// `nbd-server-stop`: stops listening; exports stay until deleted (as in QEMU, NBD
    /// exports are removed with the server).
    pub fn stop_nbd_server(&mut self) -> Result<(), DaemonError> {
        if !self.stop_server("nbd") {
            return Err(DaemonError::NbdServerNotRunning);
        }
        Ok(())
    }

    /// Stops the protocol server for export type `kind` and removes the exports offered
    /// through it; false if none runs.
    pub(super) fn stop_server(&mut self, kind: &str) -> bool {
        let Some(mut s) = self.servers.remove(kind) else {
            return false;
        };
        s.stop();
        let offered: Vec<String> = self
            .exports
            .values()
            .filter(|e| e.kind() == s.kind())
            .map(|e| e.id().to_string())
            .collect();
        for id in offered {
            self.begin_export_removal(&id);
        }
        true
    }
}
