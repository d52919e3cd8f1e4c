//! What a job announces: JOB_STATUS_CHANGE for each change of state, in the order the
//! changes were made whichever thread made them, and a block job's BLOCK_JOB_* events
//! (ready, completed, cancelled) with its progress.

use std::sync::atomic::Ordering::SeqCst;

use serde_json::json;

use super::handle::{lock, Job};
use super::status::JobStatus;

impl Job {
    /// Announced under the status lock, so the events of two threads' changes go out in
    /// the order the changes were made.
    pub(super) fn set(&self, s: JobStatus) {
        let mut status = lock(&self.status);
        if std::mem::replace(&mut *status, s) == s {
            return;
        }
        self.events.emit_here_or_post(
            "JOB_STATUS_CHANGE",
            json!({ "status": s.name(), "id": self.id }),
        );
    }

    /// The job's copy is in step: ready (once), BLOCK_JOB_READY announced.
    pub fn set_ready(&self) {
        if self.is_ready() {
            return;
        }
        self.set(JobStatus::Ready);
        self.block_event("BLOCK_JOB_READY", None);
    }

    pub(super) fn block_event(&self, name: &'static str, error: Option<&str>) {
        if !self.block {
            return;
        }
        let (cur, total) = *lock(&self.progress);
        let mut data = json!({
            "type": self.kind,
            "device": self.id,
            "len": total,
            "offset": cur,
            "speed": self.speed.load(SeqCst),
        });
        if let Some(e) = error {
            data["error"] = e.into();
        }
        self.events.emit_here_or_post(name, data);
    }
}
