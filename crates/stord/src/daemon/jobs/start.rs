//! How the daemon starts a block job once its checks passed and its holds are taken: the
//! job announced (created) as QEMU announces it, gone again if it fails before it starts
//! (`NewJob`); started in the job table with its options; its loop told, each time it
//! looks, which thread serves its node (`home_finder`); and what runs once it has ended
//! (`with_after`: a drive-* target let go, the nodes a stream or commit removed).

use std::cell::RefCell;
use std::future::Future;
use std::rc::Weak;
use std::sync::Arc;

use crate::block::node::block_node::BlockNode;
use crate::daemon::error::{invalid, DaemonError};
use crate::daemon::state::State;
use crate::job::copy_job::{run_copy, CopyJob};
use crate::job::handle::Job;
use crate::job::home::Home;
use crate::job::options::{Finish, JobOptions};

/// The thread that serves `node` now: where a job's loop and copies run. None when the
/// daemon's state is in use by a command that waits on the loop meanwhile (look again).
pub(super) fn home_of(me: &Weak<RefCell<State>>, node: &Arc<BlockNode>) -> Option<Home> {
    let Some(state) = me.upgrade() else {
        return Some(Home::Main);
    };
    let state = state.try_borrow().ok()?;
    Some(
        state
            .iothread_serving(node)
            .map_or(Home::Main, Home::IoThread),
    )
}

/// Asks, each time it is called, which thread serves `node` (a job's loop follows a node
/// moved to another IoThread while the job runs).
pub(super) fn home_finder(
    me: Weak<RefCell<State>>,
    node: Arc<BlockNode>,
) -> impl Fn() -> Option<Home> {
    move || home_of(&me, &node)
}

/// A block job QEMU has announced by now (created): one that fails before it starts is
/// announced gone (null) as it is dropped, as QEMU's job_early_fail, before the command's
/// error goes out.
pub(super) struct NewJob {
    pub(super) id: String,
    speed: u64,
    /// Made inside a drained section (a transaction action's): see
    /// [`JobOptions::drained`].
    pub(super) drained: bool,
    /// The states announced when it goes unstarted: QEMU's job_early_fail (created,
    /// null), or a transaction's abort cancelling it (created, aborting, ...).
    pub(super) gone_as: &'static [&'static str],
    /// Where the early failure is announced; None once the job has started.
    events: Option<crate::events::Events>,
}

impl NewJob {
    /// The job started: nothing to announce on drop.
    fn started(mut self) {
        self.events = None;
    }
}

impl Drop for NewJob {
    fn drop(&mut self) {
        if let Some(events) = self.events.take() {
            for &status in self.gone_as {
                events.emit(
                    "JOB_STATUS_CHANGE",
                    serde_json::json!({ "status": status, "id": self.id }),
                );
            }
        }
    }
}

impl State {
    /// A new block job's id (QEMU names one without an id after the device, which has no
    /// name in a storage daemon: refused) and speed (a negative one is refused after QEMU
    /// announced the job, created then gone).
    pub(super) fn new_block_job(
        &self,
        id: Option<&str>,
        speed: i64,
    ) -> Result<NewJob, DaemonError> {
        let id = id.unwrap_or_default().to_string();
        self.jobs.check_new(&id)?;
        let mut job = NewJob {
            id,
            speed: 0,
            drained: false,
            gone_as: &["created", "null"],
            events: Some(self.events.clone()),
        };
        job.speed = u64::try_from(speed)
            .map_err(|_| invalid("Parameter 'speed' expects a non-negative value"))?;
        Ok(job)
    }

    /// Starts a copying block job; the nodes in `removed` go once its graph change is done
    /// and nothing uses them, as QEMU frees nodes with their last reference.
    pub(super) fn start_copy_job<T: CopyJob>(
        &mut self,
        job: NewJob,
        kind: &'static str,
        how: (bool, bool),
        work: T,
        removed: Vec<String>,
        me: Weak<RefCell<State>>,
    ) -> Result<(), DaemonError> {
        let home = home_finder(me.clone(), work.node().clone());
        self.start_block_job(job, kind, how, false, move |job| {
            run_copy(work, job, home, move || {
                if let Some(state) = me.upgrade() {
                    state.borrow_mut().drop_implicit(removed);
                }
            })
        })
    }

    /// Starts block job `job`; `completable`: it waits in ready for job-complete.
    pub(super) fn start_block_job<F>(
        &mut self,
        new: NewJob,
        kind: &'static str,
        (auto_finalize, auto_dismiss): (bool, bool),
        completable: bool,
        work: impl FnOnce(Arc<Job>) -> F,
    ) -> Result<(), DaemonError>
    where
        F: Future<Output = Result<Finish, String>> + 'static,
    {
        let opts = JobOptions {
            auto_finalize,
            auto_dismiss,
            block: true,
            speed: new.speed,
            completable,
            drained: new.drained,
        };
        self.jobs.start(&new.id, kind, opts, &self.events, work)?;
        new.started();
        Ok(())
    }
}

/// Runs a closure when dropped.
pub(super) struct OnDrop(pub(super) Option<Box<dyn FnOnce()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A job's `work`, and `after` once the work and its finalize are done and dropped,
/// however the job ends (also if it is cancelled before it ever runs).
pub(super) fn with_after<F>(
    work: F,
    after: Option<Box<dyn FnOnce()>>,
) -> impl Future<Output = Result<Finish, String>>
where
    F: Future<Output = Result<Finish, String>> + 'static,
{
    let guard = OnDrop(after);
    async move {
        match work.await {
            Ok(Some(finish)) => {
                let finish: std::pin::Pin<Box<dyn Future<Output = Result<(), String>>>> =
                    Box::pin(async move {
                        let r = finish.await;
                        drop(guard);
                        r
                    });
                Ok(Some(finish))
            }
            other => {
                drop(guard);
                other
            }
        }
    }
}
