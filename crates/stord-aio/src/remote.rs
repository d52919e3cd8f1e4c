//! `Remote`: the Send + Clone handle through which other threads hand work to a context.
//!
//! Every hand-over pushes a message onto the context's lock-free queue and then notifies
//! (see [`crate::notify`]): the eventfd is written only if the loop may be asleep. Only the
//! owning thread ever touches its ring; a remote never enters it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};

use crate::context::Shared;
use crate::poll::PollParams;
use crate::reactor::ReactorInfo;
use crate::slab::Key;
use crate::stats::StatsSnapshot;
use crate::task::TaskWaker;

pub(crate) enum RemoteMsg {
    Spawn(Pin<Box<dyn Future<Output = ()> + Send>>),
    Wake(Arc<TaskWaker>),
    Bh(Key),
    SetPoll(PollParams),
    Call(Box<dyn FnOnce() + Send>),
}

/// A handle to a context that any thread may use.
#[derive(Clone)]
pub struct Remote {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("name", &self.shared.name)
            .finish()
    }
}

impl Remote {
    /// Runs `future` as a task on the context's thread.
    pub fn spawn<F>(&self, future: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.shared.send(RemoteMsg::Spawn(Box::pin(future)));
    }

    /// Runs `f` on the context's thread, soon.
    pub fn call<F>(&self, f: F)
    where
        F: FnOnce() + Send + 'static,
    {
        self.shared.send(RemoteMsg::Call(Box::new(f)));
    }

    /// Runs `f` on the context's thread and waits for its result. Must not be called
    /// from that thread (it would wait for itself). Returns None if the loop has stopped.
    pub fn run<T, F>(&self, f: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        assert!(
            !self.is_current(),
            "Remote::run called on the loop's own thread"
        );
        let (tx, rx) = mpsc::sync_channel(1);
        self.call(move || {
            let _ = tx.send(f());
        });
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(20)) {
                Ok(v) => return Some(v),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if self.shared.dead.load(Ordering::Acquire) {
                        self.shared.discard_queue();
                    }
                }
            }
        }
    }

    /// Whether the context has been dropped (its thread is gone).
    pub fn is_dead(&self) -> bool {
        self.shared.dead.load(Ordering::Acquire)
    }

    /// Changes the polling parameters (and policy) of the live loop.
    pub fn set_poll_params(&self, params: PollParams) -> Result<(), String> {
        params.validate()?;
        *self.shared.params.lock().unwrap_or_else(|e| e.into_inner()) = params;
        self.shared.send(RemoteMsg::SetPoll(params));
        Ok(())
    }

    /// The polling parameters last set.
    pub fn poll_params(&self) -> PollParams {
        *self.shared.params.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The context's statistics now.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Which reactor the context runs.
    pub fn reactor_info(&self) -> ReactorInfo {
        self.shared
            .info
            .get()
            .cloned()
            .expect("context initialised")
    }

    /// The scheduler slice the context's thread was made with (0: the kernel's default).
    pub fn sched_slice_ns(&self) -> u64 {
        self.shared.sched_slice_ns
    }

    /// The context's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The kernel thread id of the owning thread.
    pub fn thread_id(&self) -> i32 {
        self.shared.tid.load(Ordering::Relaxed)
    }

    /// Whether the calling thread is the context's own.
    pub fn is_current(&self) -> bool {
        crate::context::try_with_current(|c| Arc::ptr_eq(&c.shared, &self.shared)).unwrap_or(false)
    }

    /// Wakes the loop without giving it work (it will run one iteration).
    pub fn notify(&self) {
        self.shared.notifier.notify(&self.shared.stats);
    }
}
