//! What a job does when one of its steps fails: the policy the client chose (QEMU's
//! BlockdevOnError), the action it comes to for one failure, and the BLOCK_JOB_ERROR
//! that tells the client (a `stop` pauses the job, once however many copies in flight
//! fail together).

use std::sync::atomic::Ordering::SeqCst;

use serde_json::json;

use super::handle::{lock, Job};

/// What a job does on an I/O error (QEMU's BlockdevOnError).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Fail the job.
    Report,
    /// Go on as if the step had succeeded.
    Ignore,
    /// Pause the job (the user resumes it to retry).
    Stop,
    /// Stop on ENOSPC, report anything else.
    Enospc,
}

impl OnError {
    /// From its QMP name.
    pub fn parse(s: &str) -> Option<OnError> {
        Some(match s {
            "report" => OnError::Report,
            "ignore" => OnError::Ignore,
            "stop" => OnError::Stop,
            "enospc" => OnError::Enospc,
            _ => return None,
        })
    }
}

/// What the job does with one failed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorAction {
    Report,
    Ignore,
    /// Paused: retry the step once resumed.
    Stop,
}

impl Job {
    /// What to do with a failed step under `on_error` (BLOCK_JOB_ERROR tells the user);
    /// with Stop the job is paused by the time this returns.
    pub fn error_action(&self, on_error: OnError, read: bool, e: &std::io::Error) -> ErrorAction {
        let action = match on_error {
            OnError::Report => ErrorAction::Report,
            OnError::Ignore => ErrorAction::Ignore,
            OnError::Stop => ErrorAction::Stop,
            OnError::Enospc if e.raw_os_error() == Some(libc::ENOSPC) => ErrorAction::Stop,
            OnError::Enospc => ErrorAction::Report,
        };
        let name = match action {
            ErrorAction::Report => "report",
            ErrorAction::Ignore => "ignore",
            ErrorAction::Stop => "stop",
        };
        if action == ErrorAction::Stop {
            // As a user's pause (the user resumes it), with the failure in io-status; once,
            // however many copies in flight fail (QEMU's block_job_error_action), so one
            // resume resumes it. Paused before the event goes: a client that resumes on
            // seeing it finds the job paused.
            let mut p = lock(&self.pause);
            if !p.user {
                p.user = true;
                p.count += 1;
            }
            self.io_failed.store(true, SeqCst);
        }
        self.events.emit_here_or_post(
            "BLOCK_JOB_ERROR",
            json!({
                "device": self.id,
                "operation": if read { "read" } else { "write" },
                "action": name,
            }),
        );
        action
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Events;
    use crate::job::error::JobError;
    use crate::job::options::JobOptions;
    use crate::job::table::Jobs;
    use std::time::Duration;

    #[test]
    fn copies_that_fail_together_under_stop_pause_the_job_once() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let jobs = Jobs::default();
        // A job that stays running until cancelled.
        jobs.start(
            "s",
            "create",
            JobOptions::plain(true, true),
            &events,
            |job| async move {
                while !job.is_cancelled() {
                    job.sleep(Duration::from_millis(1)).await;
                }
                Ok(None)
            },
        )
        .unwrap();
        ctx.block_on(async { stord_aio::yield_now().await });
        let job = jobs.get("s").unwrap();
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        for _ in 0..3 {
            assert_eq!(
                job.error_action(OnError::Stop, false, &full),
                ErrorAction::Stop
            );
        }
        assert!(job.pausing());
        // One resume resumes it, as QEMU's; a second finds nothing paused.
        jobs.resume(&job).unwrap();
        assert!(!job.pausing());
        assert!(matches!(jobs.resume(&job), Err(JobError::NotPaused)));
        jobs.cancel(&job, true).unwrap();
        ctx.block_on(async {
            for _ in 0..20 {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
        });
    }
}
