//! Jobs: long operations that outlive the command that started them, with QEMU's states,
//! verbs and events.
//!
//! A job is a task on the main loop (its I/O runs wherever its nodes are served). Every
//! state change is announced as JOB_STATUS_CHANGE, in QEMU's order: created, running, then
//! on success waiting, pending, concluded; on failure aborting, concluded; and null once
//! dismissed (at once with `auto-dismiss`). `query-jobs` shows each job's state, progress
//! and error; `job-dismiss` and `job-finalize` are accepted in the states QEMU accepts them
//! in (its transition table), with its texts otherwise. This first version runs jobs that
//! need no pause or cancel points (blockdev-create).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::future::Future;
use std::rc::Rc;

use serde_json::{json, Value};

use crate::events::Events;

/// Jobs the daemon keeps at once (concluded ones stay until dismissed): a limit on what
/// clients can make it hold.
pub const MAX_JOBS: usize = 1024;

/// QEMU's JobStatus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Created,
    Running,
    Waiting,
    Pending,
    Aborting,
    Concluded,
    Null,
}

impl JobStatus {
    /// As QMP names it.
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Created => "created",
            JobStatus::Running => "running",
            JobStatus::Waiting => "waiting",
            JobStatus::Pending => "pending",
            JobStatus::Aborting => "aborting",
            JobStatus::Concluded => "concluded",
            JobStatus::Null => "null",
        }
    }
}

/// Why a job command was refused (QEMU's texts).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("Job not found")]
    NotFound,
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
}

/// One job.
pub struct Job {
    id: String,
    /// QEMU's JobType name (`create`).
    kind: &'static str,
    status: Cell<JobStatus>,
    /// (current, total) progress.
    progress: Cell<(u64, u64)>,
    error: RefCell<Option<String>>,
    auto_finalize: bool,
    auto_dismiss: bool,
    events: Events,
    /// `job-finalize` was given (auto-finalize off).
    finalized: Cell<bool>,
    /// Woken by `job-finalize` while the job waits in `pending`.
    finalize: RefCell<Option<std::task::Waker>>,
}

impl Job {
    fn set(&self, s: JobStatus) {
        self.status.set(s);
        self.events.emit(
            "JOB_STATUS_CHANGE",
            json!({ "status": s.name(), "id": self.id }),
        );
    }

    /// Sets the progress shown by query-jobs.
    pub fn set_progress(&self, current: u64, total: u64) {
        self.progress.set((current, total));
    }

    fn info(&self) -> Value {
        let (cur, total) = self.progress.get();
        let mut v = json!({
            "id": self.id,
            "type": self.kind,
            "status": self.status.get().name(),
            "current-progress": cur,
            "total-progress": total,
        });
        if let Some(e) = &*self.error.borrow() {
            v["error"] = e.clone().into();
        }
        v
    }
}

/// Every job, by id (main thread only).
#[derive(Default)]
pub struct Jobs {
    map: Rc<RefCell<BTreeMap<String, Rc<Job>>>>,
    /// Creation order, for query-jobs (QEMU lists the newest first).
    order: Rc<RefCell<Vec<String>>>,
}

/// How a job ends when its work is done.
pub struct JobOptions {
    pub auto_finalize: bool,
    pub auto_dismiss: bool,
}

impl Jobs {
    /// Starts `work` as job `id` of type `kind`; its state changes go to `events`.
    pub fn start<F>(
        &self,
        id: &str,
        kind: &'static str,
        opts: JobOptions,
        events: &Events,
        work: impl FnOnce(Rc<Job>) -> F,
    ) -> Result<(), JobError>
    where
        F: Future<Output = Result<(), String>> + 'static,
    {
        if !crate::daemon::id_wellformed(id) {
            return Err(JobError::InvalidId(id.into()));
        }
        if self.map.borrow().contains_key(id) {
            return Err(JobError::IdInUse(id.into()));
        }
        if self.map.borrow().len() >= MAX_JOBS {
            return Err(JobError::TooMany);
        }
        let job = Rc::new(Job {
            id: id.into(),
            kind,
            status: Cell::new(JobStatus::Created),
            progress: Cell::new((0, 0)),
            error: RefCell::new(None),
            auto_finalize: opts.auto_finalize,
            auto_dismiss: opts.auto_dismiss,
            events: events.clone(),
            finalized: Cell::new(false),
            finalize: RefCell::new(None),
        });
        self.map.borrow_mut().insert(id.into(), job.clone());
        self.order.borrow_mut().push(id.into());
        job.set(JobStatus::Created);
        let fut = work(job.clone());
        let (map, order) = (self.map.clone(), self.order.clone());
        stord_aio::spawn_detached(async move {
            // The command's reply goes out before the job runs, as in QEMU.
            stord_aio::yield_now().await;
            job.set(JobStatus::Running);
            match fut.await {
                Ok(()) => {
                    job.set(JobStatus::Waiting);
                    job.set(JobStatus::Pending);
                    if !job.auto_finalize {
                        std::future::poll_fn(|cx| {
                            if job.finalized.get() {
                                return std::task::Poll::Ready(());
                            }
                            *job.finalize.borrow_mut() = Some(cx.waker().clone());
                            std::task::Poll::Pending
                        })
                        .await;
                    }
                }
                Err(e) => {
                    *job.error.borrow_mut() = Some(e);
                    job.set(JobStatus::Aborting);
                }
            }
            job.set(JobStatus::Concluded);
            if job.auto_dismiss {
                job.set(JobStatus::Null);
                map.borrow_mut().remove(&job.id);
                order.borrow_mut().retain(|j| *j != job.id);
            }
        });
        Ok(())
    }

    fn get(&self, id: &str) -> Result<Rc<Job>, JobError> {
        self.map.borrow().get(id).cloned().ok_or(JobError::NotFound)
    }

    /// `job-dismiss`: a concluded job goes (null).
    pub fn dismiss(&self, id: &str) -> Result<(), JobError> {
        let job = self.get(id)?;
        if job.status.get() != JobStatus::Concluded {
            return Err(JobError::BadVerb {
                id: id.into(),
                state: job.status.get().name(),
                verb: "dismiss",
            });
        }
        job.set(JobStatus::Null);
        self.map.borrow_mut().remove(id);
        self.order.borrow_mut().retain(|j| j != id);
        Ok(())
    }

    /// `job-finalize`: a job waiting in pending (auto-finalize off) concludes.
    pub fn finalize(&self, id: &str) -> Result<(), JobError> {
        let job = self.get(id)?;
        if job.status.get() != JobStatus::Pending || job.finalized.get() {
            return Err(JobError::BadVerb {
                id: id.into(),
                state: job.status.get().name(),
                verb: "finalize",
            });
        }
        // The job's task concludes it; it only waits for this.
        job.finalized.set(true);
        if let Some(w) = job.finalize.borrow_mut().take() {
            w.wake();
        }
        Ok(())
    }

    /// `query-jobs`: newest first.
    pub fn query(&self) -> Value {
        let map = self.map.borrow();
        Value::Array(
            self.order
                .borrow()
                .iter()
                .rev()
                .filter_map(|id| map.get(id).map(|j| j.info()))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::EventSink;

    #[derive(Default)]
    struct Seen(RefCell<Vec<String>>);
    impl EventSink for Seen {
        fn deliver(&self, e: &Value) {
            self.0.borrow_mut().push(format!(
                "{}:{}",
                e["data"]["id"].as_str().unwrap(),
                e["data"]["status"].as_str().unwrap()
            ));
        }
        fn listening(&self) -> bool {
            true
        }
        fn flushed(&self) -> bool {
            true
        }
    }

    #[test]
    fn states_follow_qemus_order_with_and_without_auto_finalize() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let seen = Rc::new(Seen::default());
        let sink: Rc<dyn EventSink> = seen.clone();
        events.subscribe(Rc::downgrade(&sink));
        let jobs = Jobs::default();
        let manual = JobOptions {
            auto_finalize: false,
            auto_dismiss: true,
        };
        jobs.start("a", "create", manual, &events, |_| async { Ok(()) })
            .unwrap();
        let auto = JobOptions {
            auto_finalize: true,
            auto_dismiss: false,
        };
        jobs.start("b", "create", auto, &events, |_| async {
            Err("no".to_string())
        })
        .unwrap();
        assert!(matches!(
            jobs.start(
                "b",
                "create",
                JobOptions {
                    auto_finalize: true,
                    auto_dismiss: true
                },
                &events,
                |_| async { Ok(()) }
            ),
            Err(JobError::IdInUse(_))
        ));
        assert!(matches!(jobs.dismiss("a"), Err(JobError::BadVerb { .. })));
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        // a waits in pending for job-finalize; b failed and stays concluded.
        assert_eq!(jobs.query()[1]["status"], "pending");
        assert_eq!(jobs.query()[0]["error"], "no");
        jobs.finalize("a").unwrap();
        ctx.block_on(async {
            for _ in 0..10 {
                stord_aio::yield_now().await;
            }
        });
        jobs.dismiss("b").unwrap();
        let got = seen.0.borrow().clone();
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
