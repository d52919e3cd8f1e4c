//! The daemon's part of `blockdev-create`: a job of type `create` that runs what a
//! driver prepared ([`crate::block::create`]), and the job table the `job-*` commands
//! reach.

use crate::daemon::error::DaemonError;
use crate::daemon::state::State;

/// Jobs.
impl State {
    /// The jobs (query-jobs, job-dismiss, job-finalize).
    pub fn jobs(&self) -> &crate::job::table::Jobs {
        &self.jobs
    }

    /// `blockdev-create`: a job of type `create` (no auto-dismiss, as QEMU's) that runs
    /// the work the driver prepared; what is wrong with the options found then (a node
    /// not found, QEMU's checks) fails the job, not the command, as in QEMU.
    pub fn blockdev_create(
        &mut self,
        job_id: &str,
        creation: crate::block::create::Creation,
    ) -> Result<(), DaemonError> {
        let opts = crate::job::options::JobOptions::plain(true, false);
        self.jobs.start(
            job_id,
            "create",
            opts,
            &self.events,
            move |job| async move {
                job.set_progress(0, 1);
                let r = creation.await;
                // As QEMU: the one step counts as done whatever its outcome.
                job.set_progress(1, 1);
                r.map(|()| None)
            },
        )?;
        Ok(())
    }
}
