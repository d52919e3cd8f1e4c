//! Why a job command was refused, in QEMU's texts and error classes.

/// Jobs the daemon keeps at once (concluded ones stay until dismissed): a limit on what
/// clients can make it hold.
pub const MAX_JOBS: usize = 1024;

/// Why a job command was refused (QEMU's texts).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("Job not found")]
    NotFound,
    /// A `block-job-*` command naming no block job (class DeviceNotActive).
    #[error("Block job '{0}' not found")]
    BlockJobNotFound(String),
    #[error("Job ID '{0}' already in use")]
    IdInUse(String),
    #[error("Invalid job ID '{0}'")]
    InvalidId(String),
    #[error("Too many jobs ({MAX_JOBS}): dismiss concluded ones first")]
    TooMany,
    #[error("Job '{id}' in state '{state}' cannot accept command verb '{verb}'")]
    BadVerb {
        id: String,
        state: &'static str,
        verb: &'static str,
    },
    #[error("Job is already paused")]
    AlreadyPaused,
    #[error("Can't resume a job that was not paused")]
    NotPaused,
    #[error("The active block job '{0}' cannot be completed")]
    CannotComplete(String),
    #[error("The block job for device '{0}' is currently paused")]
    Paused(String),
    #[error("Parameter 'speed' expects a non-negative value")]
    Speed,
    /// A job type's own refusal (QEMU's text).
    #[error("{0}")]
    Other(String),
}

impl JobError {
    /// The QMP error class (QEMU's).
    pub fn qmp_class(&self) -> &'static str {
        match self {
            JobError::BlockJobNotFound(_) => "DeviceNotActive",
            _ => "GenericError",
        }
    }
}
