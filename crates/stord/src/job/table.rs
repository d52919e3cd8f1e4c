//! Every job, by id: the table the daemon keeps ([`Jobs`]), with the look-ups the verbs
//! and the daemon use. Jobs are added by [`Jobs::start`] ([`super::lifecycle`]), changed
//! by the verbs ([`super::verbs`]) and listed by the queries ([`super::query`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use super::error::{JobError, MAX_JOBS};
use super::handle::{lock, Job};

/// Every job, by id (main thread only); clones share the table.
#[derive(Default, Clone)]
pub struct Jobs {
    pub(super) map: Rc<RefCell<BTreeMap<String, Arc<Job>>>>,
    /// Creation order, for query-jobs (QEMU lists the newest first).
    pub(super) order: Rc<RefCell<Vec<String>>>,
}

impl Jobs {
    /// Whether `id` could start now (well formed, free, within the limit).
    pub fn check_new(&self, id: &str) -> Result<(), JobError> {
        if !crate::cli::id_wellformed(id) {
            return Err(JobError::InvalidId(id.into()));
        }
        if self.map.borrow().contains_key(id) {
            return Err(JobError::IdInUse(id.into()));
        }
        if self.map.borrow().len() >= MAX_JOBS {
            return Err(JobError::TooMany);
        }
        Ok(())
    }

    /// A node moved to another thread (x-blockdev-set-iothread): every job looks again,
    /// so the loop of a job on it goes along, even paused (its pause ends on the thread
    /// the node left and goes on on the new one).
    pub fn node_moved(&self) {
        for job in self.map.borrow().values() {
            job.wake();
        }
    }

    /// Whether a job's loop runs on IoThread `id` now (until it has left, the thread is
    /// in use even after the node moved away).
    pub fn loop_on(&self, id: &str) -> bool {
        self.map
            .borrow()
            .values()
            .any(|job| lock(&job.stay).as_ref().is_some_and(|s| s.on(id)))
    }

    pub(super) fn get(&self, id: &str) -> Result<Arc<Job>, JobError> {
        self.map.borrow().get(id).cloned().ok_or(JobError::NotFound)
    }

    /// A block job by the id `block-job-*` commands call `device`.
    pub fn get_block(&self, id: &str) -> Result<Arc<Job>, JobError> {
        match self.map.borrow().get(id) {
            Some(j) if j.block => Ok(j.clone()),
            _ => Err(JobError::BlockJobNotFound(id.into())),
        }
    }

    /// The job `id`, `block` ones looked up as `block-job-*` commands do.
    pub fn find(&self, id: &str, block: bool) -> Result<Arc<Job>, JobError> {
        if block {
            self.get_block(id)
        } else {
            self.get(id)
        }
    }
}
