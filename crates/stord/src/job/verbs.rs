//! The verbs: `job-*` and `block-job-*` (dismiss, finalize, pause, resume, cancel,
//! complete, change, set-speed), each first checked against QEMU's verb table
//! ([`super::status::Verb`]) with its texts, and the cancel of every job at the daemon's
//! stop.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use serde_json::Value;

use super::error::JobError;
use super::handle::{lock, Job};
use super::rate_limit::RateLimit;
use super::status::{JobStatus, Verb};
use super::table::Jobs;

impl Job {
    /// `job-cancel`: a paused job is resumed to stop; a ready job that can be completed
    /// and is not forced ends as completed, its graph change left undone.
    pub(super) fn cancel(&self, force: bool) -> Result<(), JobError> {
        self.check(Verb::Cancel)?;
        {
            let mut p = lock(&self.pause);
            if std::mem::replace(&mut p.user, false) {
                p.count = p.count.saturating_sub(1);
            }
        }
        if !force && self.completable && self.is_ready() {
            self.soft_cancelled.store(true, SeqCst);
            self.wake();
            return Ok(());
        }
        self.cancelled.store(true, SeqCst);
        self.force_cancel.fetch_or(force, SeqCst);
        self.wake();
        Ok(())
    }

    fn check(&self, verb: Verb) -> Result<(), JobError> {
        let status = self.status();
        if verb.allowed(status) {
            return Ok(());
        }
        Err(JobError::BadVerb {
            id: self.id.clone(),
            state: status.name(),
            verb: verb.name(),
        })
    }
}

impl Jobs {
    /// `job-dismiss`: a concluded job goes (null).
    pub fn dismiss(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Dismiss)?;
        job.set(JobStatus::Null);
        self.map.borrow_mut().remove(&job.id);
        self.order.borrow_mut().retain(|j| *j != job.id);
        Ok(())
    }

    /// `job-finalize`: a job waiting in pending (auto-finalize off) concludes.
    pub fn finalize(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Finalize)?;
        if job.finalized.swap(true, SeqCst) {
            return Err(JobError::BadVerb {
                id: job.id.clone(),
                state: job.status().name(),
                verb: "finalize",
            });
        }
        job.wake();
        Ok(())
    }

    /// `job-pause`: the job pauses at its next pause point.
    pub fn pause(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Pause)?;
        {
            let mut p = lock(&job.pause);
            if p.user {
                return Err(JobError::AlreadyPaused);
            }
            p.user = true;
            p.count += 1;
        }
        job.wake();
        Ok(())
    }

    /// `job-resume`.
    pub fn resume(&self, job: &Job) -> Result<(), JobError> {
        {
            let p = *lock(&job.pause);
            if !p.user || p.count == 0 {
                return Err(JobError::NotPaused);
            }
        }
        job.check(Verb::Resume)?;
        {
            let mut p = lock(&job.pause);
            if p.user && p.count > 0 {
                p.user = false;
                p.count -= 1;
            }
        }
        job.wake();
        Ok(())
    }

    /// `job-cancel` (force) and `block-job-cancel`: a paused job is resumed to stop.
    pub fn cancel(&self, job: &Job, force: bool) -> Result<(), JobError> {
        job.cancel(force)
    }

    /// `block-job-cancel`: refused for a paused job unless forced, as QEMU.
    pub fn block_cancel(&self, job: &Job, force: bool) -> Result<(), JobError> {
        if lock(&job.pause).user && !force {
            return Err(JobError::Paused(job.id.clone()));
        }
        self.cancel(job, force)
    }

    /// `job-complete`: a ready job finishes its work.
    pub fn complete(&self, job: &Job) -> Result<(), JobError> {
        job.check(Verb::Complete)?;
        if job.pause_count() > 0 || job.is_cancelled() || !job.completable {
            return Err(JobError::CannotComplete(job.id.clone()));
        }
        job.complete_requested.store(true, SeqCst);
        job.wake();
        Ok(())
    }

    /// `block-job-change`: QEMU's verb check, then the job type's own.
    pub fn change(
        &self,
        job: &Job,
        options: &serde_json::Map<String, Value>,
    ) -> Result<(), JobError> {
        job.check(Verb::Change)?;
        let ext = lock(&job.ext).clone();
        match ext {
            Some(t) => t.change(options).map_err(JobError::Other),
            None => Err(JobError::Other("Job type does not support change".into())),
        }
    }

    /// `block-job-set-speed`.
    pub fn set_speed(&self, job: &Job, speed: i64) -> Result<(), JobError> {
        job.check(Verb::SetSpeed)?;
        let Ok(speed) = u64::try_from(speed) else {
            return Err(JobError::Speed);
        };
        let old = job.speed.swap(speed, SeqCst);
        *lock(&job.limit) = RateLimit::new(speed);
        if speed == 0 || speed > old {
            // A job asleep for the old limit goes on now.
            job.wake();
        }
        Ok(())
    }

    /// At the daemon's stop, as QEMU's job_cancel_sync_all: every job is cancelled (as
    /// `job-cancel` does, forced) and, once concluded, dismissed; completes when none is
    /// left.
    pub async fn cancel_all(&self) {
        // Newest first, one at a time, as QEMU walks its job list.
        loop {
            let newest = {
                let map = self.map.borrow();
                let order = self.order.borrow();
                order.iter().rev().find_map(|id| map.get(id).cloned())
            };
            let Some(job) = newest else { return };
            let _ = self.cancel(&job, true);
            // The job finishes on this loop: look again shortly.
            while job.status() != JobStatus::Concluded && self.map.borrow().contains_key(&job.id) {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
            if job.status() == JobStatus::Concluded {
                let _ = self.dismiss(&job);
            }
            self.map.borrow_mut().remove(&job.id);
            self.order.borrow_mut().retain(|j| *j != job.id);
        }
    }
}
