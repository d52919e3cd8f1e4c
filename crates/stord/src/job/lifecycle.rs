//! A job's life, in QEMU's order: created and running before the command's reply, its
//! work run after it, then on success waiting, pending (held there until `job-finalize`
//! without `auto-finalize`) and its graph change ([`Finish`]); on failure or cancel
//! aborting; concluded either way, and null once dismissed (at once with
//! `auto-dismiss`).

use std::future::Future;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use serde_json::json;

use super::error::JobError;
use super::handle::{lock, Job};
use super::options::{Finish, JobOptions};
use super::status::JobStatus;
use super::table::Jobs;
use crate::events::Events;

impl Jobs {
    /// Starts `work` as job `id` of type `kind`; its state changes go to `events`.
    pub fn start<F>(
        &self,
        id: &str,
        kind: &'static str,
        opts: JobOptions,
        events: &Events,
        work: impl FnOnce(Arc<Job>) -> F,
    ) -> Result<(), JobError>
    where
        F: Future<Output = Result<Finish, String>> + 'static,
    {
        self.check_new(id)?;
        let Some(poster) = events.poster() else {
            return Err(JobError::Other("jobs run on a loop".into()));
        };
        let job = Arc::new(Job::new(id, kind, &opts, poster));
        self.map.borrow_mut().insert(id.into(), job.clone());
        self.order.borrow_mut().push(id.into());
        events.emit(
            "JOB_STATUS_CHANGE",
            json!({ "status": "created", "id": job.id }),
        );
        let fut = work(job.clone());
        let (map, order) = (self.map.clone(), self.order.clone());
        // Running before the command's reply, as QEMU's job_start; the work itself starts
        // after the reply has gone out.
        job.set(JobStatus::Running);
        if opts.drained {
            job.set(JobStatus::Paused);
            job.set(JobStatus::Running);
        }
        stord_aio::spawn_detached(async move {
            stord_aio::yield_now().await;
            // As QEMU's job_co_entry: a pause asked for before the start holds here.
            job.pause_point().await;
            let r = if job.is_cancelled() {
                Ok(None)
            } else {
                fut.await
            };
            Self::conclude(&job, r).await;
            if job.auto_dismiss {
                job.set(JobStatus::Null);
                map.borrow_mut().remove(&job.id);
                order.borrow_mut().retain(|j| *j != job.id);
            }
        });
        Ok(())
    }

    /// From the end of the work to concluded, in QEMU's order.
    async fn conclude(job: &Arc<Job>, r: Result<Finish, String>) {
        let fail = |e: String, cancelled: bool| {
            *lock(&job.error) = Some(e.clone());
            job.set(JobStatus::Aborting);
            if cancelled {
                job.block_event("BLOCK_JOB_CANCELLED", None);
            } else {
                job.block_event("BLOCK_JOB_COMPLETED", Some(&e));
            }
        };
        let finish = match r {
            _ if job.is_cancelled() => {
                fail("Operation canceled".into(), true);
                None
            }
            Err(e) => {
                fail(e, false);
                None
            }
            Ok(f) => Some(f),
        };
        if let Some(f) = finish {
            job.set(JobStatus::Waiting);
            job.set(JobStatus::Pending);
            if !job.auto_finalize {
                if job.block {
                    job.events.emit_here_or_post(
                        "BLOCK_JOB_PENDING",
                        json!({ "type": job.kind, "id": job.id }),
                    );
                }
                job.wait_until(|| job.finalized.load(SeqCst) || job.is_cancelled())
                    .await;
            }
            if job.is_cancelled() {
                fail("Operation canceled".into(), true);
            } else {
                match f {
                    Some(f) => match f.await {
                        Ok(()) => job.block_event("BLOCK_JOB_COMPLETED", None),
                        Err(e) => fail(e, false),
                    },
                    None => job.block_event("BLOCK_JOB_COMPLETED", None),
                }
            }
        }
        job.set(JobStatus::Concluded);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn states_follow_qemus_order_with_and_without_auto_finalize() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let seen = crate::events::Recorder::listen(&events);
        let jobs = Jobs::default();
        let manual = JobOptions::plain(false, true);
        jobs.start("a", "create", manual, &events, |_| async { Ok(None) })
            .unwrap();
        let auto = JobOptions::plain(true, false);
        jobs.start("b", "create", auto, &events, |_| async {
            Err("no".to_string())
        })
        .unwrap();
        assert!(matches!(
            jobs.start(
                "b",
                "create",
                JobOptions::plain(true, true),
                &events,
                |_| async { Ok(None) }
            ),
            Err(JobError::IdInUse(_))
        ));
        assert!(matches!(
            jobs.dismiss(&jobs.get("a").unwrap()),
            Err(JobError::BadVerb { .. })
        ));
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        // a waits in pending for job-finalize; b failed and stays concluded.
        assert_eq!(jobs.query()[1]["status"], "pending");
        assert_eq!(jobs.query()[0]["error"], "no");
        jobs.finalize(&jobs.get("a").unwrap()).unwrap();
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        jobs.dismiss(&jobs.get("b").unwrap()).unwrap();
        // Each status change as "id:status".
        let got: Vec<String> = seen
            .got
            .borrow()
            .iter()
            .map(|e| {
                format!(
                    "{}:{}",
                    e["data"]["id"].as_str().unwrap(),
                    e["data"]["status"].as_str().unwrap()
                )
            })
            .collect();
        let of = |id: &str| -> Vec<String> {
            got.iter()
                .filter(|e| e.starts_with(&format!("{id}:")))
                .map(|e| e[2..].to_string())
                .collect()
        };
        assert_eq!(
            of("a"),
            [
                "created",
                "running",
                "waiting",
                "pending",
                "concluded",
                "null"
            ]
        );
        assert_eq!(
            of("b"),
            ["created", "running", "aborting", "concluded", "null"]
        );
        assert_eq!(jobs.query(), Value::Array(vec![]));
    }
}
