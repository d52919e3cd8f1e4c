//! `--object` / `object-add` types as a table: each [`ObjectType`] names a `qom-type` and
//! builds it from its options into the daemon's state, so a new type is one entry and one
//! function. `object-del` refuses an object something still uses.

use std::sync::Arc;

use stord_aio::{AioContextOptions, IoThread};

use super::error::DaemonError;
use super::state::State;
use super::user_object::UserObject;
use crate::block::throttle_group::ThrottleGroup;
use crate::cli::keyval::KeyVal;
use crate::cli::{id_wellformed, Help};
use crate::secret::Secret;
use crate::tls::authz::AuthzSimple;
use crate::tls::creds::TlsCreds;

/// Builds one object of a type from its options (`qom-type` and `id` taken, the id free).
pub type Create = fn(&mut State, &str, &str, KeyVal) -> Result<(), DaemonError>;

/// One `qom-type`.
pub struct ObjectType {
    pub name: &'static str,
    pub create: Create,
    /// Its properties beside `qom-type` and `id`, for `--help`, `--object TYPE,help` and
    /// docs/usage.md.
    pub help: Help,
}

/// Every object type `--object` and `object-add` take.
pub const OBJECT_TYPES: &[ObjectType] = &[
    ObjectType {
        name: "iothread",
        create: create_iothread,
        help: Help {
            synopsis: "[,poll-max-ns=<ns> (default 65536)]\n\
                   [,poll-grow=<n>][,poll-shrink=<n>]\n\
                   [,poll-weight=<0..63>][,poll-policy=adaptive|off|classic|weighted|haltpoll]\n\
                   [,poll-grow-start=<ns>][,poll-allow-shrink=on|off][,poll-yield-ns=<ns>]\n\
                   [,reactor=auto|io_uring|epoll]\n\
                   [,sched-slice-ns=<ns> (default 100000; 0: the kernel's slice)]",
            about: "an IoThread (an event loop on its own thread)",
        },
    },
    ObjectType {
        name: "throttle-group",
        create: create_throttle_group,
        help: Help {
            synopsis: "[,x-iops-total=<n>][,x-iops-read=<n>][,x-iops-write=<n>]\n\
                   [,x-bps-total=<n>][,x-bps-read=<n>][,x-bps-write=<n>]\n\
                   [,x-<limit>-max=<n>][,x-<limit>-max-length=<s>][,x-iops-size=<bytes>]\n\
                   (also limits.<limit>=...)",
            about: "limits shared by the throttle nodes of the group",
        },
    },
    ObjectType {
        name: "tls-creds-x509",
        create: create_tls_creds,
        help: Help {
            synopsis: ",endpoint=server|client,dir=<dir>\n\
                   [,verify-peer=on|off]\n\
                   [,passwordid=<secret id>][,sanity-check=on|off]",
            about: "TLS certificates: <dir>/ca-cert.pem, server-cert.pem and\n\
                    server-key.pem (client-*.pem for endpoint=client; ca-crl.pem\n\
                    if present); verify-peer=on (the default) requires the peer\n\
                    to present a certificate the CA signed",
        },
    },
    ObjectType {
        name: "tls-creds-psk",
        create: create_tls_creds,
        help: Help {
            synopsis: ",endpoint=server|client,dir=<dir>[,username=<name>]",
            about: "TLS pre-shared keys: <dir>/keys.psk, username:hexkey per line",
        },
    },
    ObjectType {
        name: "authz-simple",
        create: create_authz,
        help: Help {
            synopsis: ",identity=<name>",
            about: "the one TLS client admitted: its certificate's name as QEMU\n\
                    writes it (C=GB,,O=Example,,CN=client: commas doubled) or\n\
                    its PSK username",
        },
    },
    ObjectType {
        name: "metrics",
        create: create_metrics,
        help: Help {
            synopsis: ",addr.type=unix,addr.path=<path>\n\
                   | ,addr.type=inet,addr.host=<host>,addr.port=<port>",
            about: "stord's own: every node's query-blockstats counters as\n\
                    OpenMetrics text over HTTP (a Prometheus scrape target)",
        },
    },
    ObjectType {
        name: "monitor-qmp",
        create: create_monitor_qmp,
        help: Help {
            synopsis: ",chardev=<id>[,pretty=on|off][,close-action=none|delete]",
            about: "a QMP monitor on a chardev (QEMU 11.1), made and removed at\n\
                    run time (object-add, object-del); close-action=delete\n\
                    removes it and its chardev once its client hangs up",
        },
    },
    ObjectType {
        name: "secret",
        create: create_secret,
        help: Help {
            synopsis: ",data=<text> | ,file=<path>[,format=raw|base64]\n\
                       [,keyid=<id>,iv=<base64>]",
            about: "a secret (a passphrase, a LUKS password, a Ceph key);\n\
                    with keyid, AES-256-CBC encrypted under that secret",
        },
    },
];

fn create_authz(st: &mut State, _: &str, id: &str, mut kv: KeyVal) -> Result<(), DaemonError> {
    let a = AuthzSimple::from_object(&mut kv)?;
    kv.finish()?;
    st.objects.insert(id.into(), UserObject::Authz(Arc::new(a)));
    Ok(())
}

fn create_metrics(st: &mut State, _: &str, id: &str, mut kv: KeyVal) -> Result<(), DaemonError> {
    let addr = crate::export::nbd::options::ListenAddr::from_options(&mut kv)?;
    kv.finish()?;
    let me = st.me.clone();
    let source: crate::metrics::Source = std::rc::Rc::new(move || {
        let Some(state) = me.upgrade() else {
            return Vec::new();
        };
        let st = state.borrow();
        st.nodes()
            .map(|n| (n.name.clone(), n.stats.to_qmp()))
            .collect()
    });
    let server = stord_aio::with_current_context(|ctx| {
        crate::metrics::MetricsServer::start(ctx, &addr, source)
    })
    .ok_or_else(|| DaemonError::Invalid("metrics: not on the main loop".into()))?
    .map_err(|source| DaemonError::Listen {
        addr: addr.to_string(),
        source,
    })?;
    st.metrics.insert(id.into(), server);
    Ok(())
}

fn create_monitor_qmp(st: &mut State, _: &str, id: &str, kv: KeyVal) -> Result<(), DaemonError> {
    st.create_monitor(id, kv)
}

fn create_secret(st: &mut State, _: &str, id: &str, mut kv: KeyVal) -> Result<(), DaemonError> {
    let s = Secret::from_object(&mut kv, &|key| st.secret(key))?;
    kv.finish()?;
    st.objects.insert(id.into(), UserObject::Secret(s));
    Ok(())
}

fn create_iothread(st: &mut State, _: &str, id: &str, mut kv: KeyVal) -> Result<(), DaemonError> {
    let config = crate::iothread::from_options(&mut kv)?;
    kv.finish()?;
    let thread = IoThread::spawn(AioContextOptions {
        name: id.into(),
        reactor: config.reactor,
        poll: config.poll,
        sched_slice_ns: config.sched_slice_ns,
    })
    .map_err(|source| DaemonError::IoThreadStart {
        id: id.into(),
        source,
    })?;
    st.iothreads.insert(id.into(), thread);
    Ok(())
}

fn create_throttle_group(
    st: &mut State,
    _: &str,
    id: &str,
    mut kv: KeyVal,
) -> Result<(), DaemonError> {
    let group = ThrottleGroup::from_opts(id.into(), &mut kv)?;
    kv.finish()?;
    st.throttle_groups.insert(id.into(), Arc::new(group));
    Ok(())
}

fn create_tls_creds(
    st: &mut State,
    kind: &str,
    id: &str,
    mut kv: KeyVal,
) -> Result<(), DaemonError> {
    let creds = TlsCreds::from_object(kind, &mut kv, &|id: &str| st.secret(id))?;
    kv.finish()?;
    st.objects
        .insert(id.into(), UserObject::TlsCreds(Arc::new(creds)));
    Ok(())
}

impl State {
    /// `--object` / `object-add`.
    pub fn add_object(&mut self, mut kv: KeyVal) -> Result<(), DaemonError> {
        let kind = kv.take_required("qom-type")?;
        let Some(t) = OBJECT_TYPES.iter().find(|t| t.name == kind) else {
            let names: Vec<&str> = OBJECT_TYPES.iter().map(|t| t.name).collect();
            return Err(kv
                .bad_value(
                    "qom-type",
                    &format!("a supported object type ({})", names.join(", ")),
                    &kind,
                )
                .into());
        };
        let id = kv.take_required("id")?;
        if !id_wellformed(&id) {
            return Err(DaemonError::Invalid(
                "Parameter 'id' expects an identifier".into(),
            ));
        }
        if self.iothreads.contains_key(&id)
            || self.throttle_groups.contains_key(&id)
            || self.objects.contains_key(&id)
            || self.metrics.contains_key(&id)
            || self.monitors.contains_key(&id)
        {
            return Err(DaemonError::DuplicateObject(id));
        }
        (t.create)(self, &kind, &id, kv)
    }

    /// Every object by id, with its `qom-type`.
    pub fn object_types(&self) -> Vec<(String, &'static str)> {
        let mut v: Vec<_> = self
            .iothreads
            .keys()
            .map(|id| (id.clone(), "iothread"))
            .chain(
                self.throttle_groups
                    .keys()
                    .map(|id| (id.clone(), "throttle-group")),
            )
            .chain(
                self.objects
                    .iter()
                    .map(|(id, o)| (id.clone(), o.type_name())),
            )
            .chain(self.metrics.keys().map(|id| (id.clone(), "metrics")))
            .chain(self.monitors.keys().map(|id| (id.clone(), "monitor-qmp")))
            .collect();
        v.sort();
        v
    }

    /// `object-del`: fails while something uses the object (an export runs on the
    /// iothread, a node is in the throttle group, the NBD server holds the credentials).
    pub fn del_object(&mut self, id: &str) -> Result<(), DaemonError> {
        if let Some(obj) = self.objects.get(id) {
            if obj.in_use() {
                return Err(DaemonError::ObjectInUse(id.into()));
            }
            self.objects.remove(id);
            return Ok(());
        }
        if self.metrics.remove(id).is_some() {
            return Ok(());
        }
        if self.monitors.contains_key(id) {
            return self.delete_monitor(id);
        }
        if let Some(group) = self.throttle_groups.get(id) {
            // Held by the table and by each throttle node in the group.
            if Arc::strong_count(group) > 1 {
                return Err(DaemonError::ObjectInUse(id.into()));
            }
            self.throttle_groups.remove(id);
            return Ok(());
        }
        let Some(obj) = self.iothreads.get(id) else {
            return Err(DaemonError::ObjectNotFound(id.into()));
        };
        let remote = obj.remote().clone();
        let home_of_a_node = self.nodes.values().any(|n| n.home().as_deref() == Some(id));
        if home_of_a_node
            || self.exports.values().any(|e| e.runs_on(&remote))
            || self.jobs.loop_on(id)
        {
            return Err(DaemonError::ObjectInUse(id.into()));
        }
        if let Some(mut obj) = self.iothreads.remove(id) {
            obj.stop();
        }
        Ok(())
    }
}

impl State {
    /// The bytes of the `secret` object `id`, if there is one.
    pub(crate) fn secret(&self, id: &str) -> Option<Vec<u8>> {
        match self.objects.get(id) {
            Some(UserObject::Secret(s)) => Some(s.bytes().to_vec()),
            _ => None,
        }
    }

    /// The `endpoint=client` TLS credentials `id`, or why not, in QEMU's words.
    pub(crate) fn client_tls_creds(&self, id: &str) -> Result<Arc<TlsCreds>, String> {
        match self.objects.get(id) {
            Some(UserObject::TlsCreds(c)) if c.is_client() => Ok(c.clone()),
            Some(UserObject::TlsCreds(_)) => {
                Err("Expected TLS credentials for a client endpoint".into())
            }
            Some(_) => Err(format!("Object with id '{id}' is not TLS credentials")),
            None => Err(format!("No TLS credentials with id '{id}'")),
        }
    }
}
