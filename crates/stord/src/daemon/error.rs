//! The daemon layer's error, [`DaemonError`], and the QMP class each kind reports.

use std::io;

use crate::cli::keyval::OptionError;
use crate::secret::SecretError;
use crate::tls::error::TlsError;

/// Why a command on the daemon's objects, nodes or exports failed: the daemon layer's
/// error. QMP reports it with [`DaemonError::qmp_class`]; the texts are qsd's where it has
/// one, so scripts that match them keep working.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A malformed option list.
    #[error(transparent)]
    Option(#[from] OptionError),
    /// Options that parse but describe something we cannot build (a driver's or export's
    /// own checks).
    #[error("{0}")]
    Invalid(String),
    #[error("attempt to add duplicate property '{0}' to object (type 'container')")]
    DuplicateObject(String),
    #[error("object '{0}' not found")]
    ObjectNotFound(String),
    #[error("object '{0}' is in use and cannot be deleted")]
    ObjectInUse(String),
    #[error("cannot start iothread '{id}': {source}")]
    IoThreadStart { id: String, source: io::Error },
    #[error("Failed to find node with node-name='{0}'")]
    NodeNotFound(String),
    #[error(transparent)]
    Graph(#[from] crate::block::open::GraphError),
    #[error(transparent)]
    Export(#[from] crate::export::ExportError),
    #[error(transparent)]
    Throttle(#[from] crate::block::throttle_group::ThrottleConfigError),
    #[error(transparent)]
    Job(#[from] crate::job::JobError),
    #[error("Block device {name} is in use (it is the '{role}' child of node '{parent}')")]
    NodeIsChild {
        name: String,
        parent: String,
        role: &'static str,
    },
    /// A `device` naming nothing (class DeviceNotFound, which libvirt probes for).
    #[error("Device '{0}' not found")]
    DeviceNotFound(String),
    #[error("Node {0} is not owned by the monitor")]
    NodeNotOwned(String),
    #[error("Node {0} is in use")]
    NodeInUse(String),
    #[error("Block export id '{0}' is already in use")]
    ExportIdTaken(String),
    #[error("Export '{0}' is not found")]
    ExportNotFound(String),
    #[error("Export '{0}' is already shutting down")]
    ExportShuttingDown(String),
    #[error("export '{0}' still in use (use mode 'hard' to disconnect its clients)")]
    ExportInUse(String),
    #[error("NBD server already running")]
    NbdServerRunning,
    #[error("NBD server not running")]
    NbdServerNotRunning,
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error(transparent)]
    Perm(#[from] crate::block::node::perm::PermError),
    /// A job has the node ("Node 'x' is busy: ...").
    #[error(transparent)]
    Busy(#[from] crate::block::node::blocker::Busy),
    #[error(transparent)]
    Property(#[from] crate::iothread::PropertyError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Secret(#[from] SecretError),
    #[error("No TLS credentials with id '{0}'")]
    NoTlsCreds(String),
    #[error("No authorization object with id '{0}'")]
    NoAuthz(String),
}

impl DaemonError {
    /// The QMP error class: qsd reports all of these as GenericError.
    pub fn qmp_class(&self) -> &'static str {
        match self {
            DaemonError::Job(e) => e.qmp_class(),
            DaemonError::DeviceNotFound(_) => "DeviceNotFound",
            _ => "GenericError",
        }
    }
}

/// A GenericError with QEMU's text.
pub(super) fn invalid(s: impl Into<String>) -> DaemonError {
    DaemonError::Invalid(s.into())
}
