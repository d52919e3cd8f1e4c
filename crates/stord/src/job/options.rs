//! How a job is made ([`JobOptions`]), what a block job holds on the graph while it lasts
//! ([`Holds`]), and what it leaves to be done at finalize ([`Finish`]).

use std::future::Future;
use std::pin::Pin;

/// QEMU's prepare: what a job that did its work changes once it is finalized (the graph
/// change of stream and commit). It runs only if the job was not cancelled first.
pub type Finish = Option<Pin<Box<dyn Future<Output = Result<(), String>>>>>;

/// What a block job holds on the graph while it lasts.
pub struct Holds {
    pub claims: Vec<crate::block::node::block_node::Claim>,
    pub blockers: Vec<crate::block::node::blocker::Blocker>,
    /// The job on the node it was started on.
    pub attached: crate::block::node::blocker::JobAttachment,
    /// Nodes made writable for the job, read-only again after it.
    pub reopened: crate::block::node::read_only_again::ReadOnlyAgain,
}

/// How a job is made and ends.
pub struct JobOptions {
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
    /// A block job (BLOCK_JOB_* events).
    pub block: bool,
    /// Bytes per second (0: unlimited).
    pub speed: u64,
    /// It waits in ready for `job-complete`.
    pub completable: bool,
    /// Started inside a drained section that ends right after (QEMU runs blockdev-backup
    /// as a transaction action, which drains the source from prepare to clean): the job
    /// is paused at its first pause point and resumed as the section ends, both
    /// announced before the command's reply.
    pub drained: bool,
}

impl JobOptions {
    /// A job that is not a block job (blockdev-create).
    pub fn plain(auto_finalize: bool, auto_dismiss: bool) -> Self {
        JobOptions {
            auto_finalize,
            auto_dismiss,
            block: false,
            speed: 0,
            completable: false,
            drained: false,
        }
    }
}
