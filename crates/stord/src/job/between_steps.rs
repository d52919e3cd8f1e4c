//! Between a job's steps: where pause, cancel and the speed limit take effect. The work
//! calls [`Job::pause_point`], [`Job::sleep`] or [`Job::ratelimit`] between its steps; a
//! verb on another thread wakes it to look (`Job::wake`). A pause on a thread the job's
//! node left ends early, still paused, so the loop moves along ([`super::job_loop`]).

use std::future::Future;
use std::sync::atomic::Ordering::SeqCst;
use std::task::Poll;
use std::time::Duration;

use super::handle::{lock, Job};
use super::status::JobStatus;
use super::stay::Stay;

impl Job {
    /// A verb happened: the job's task looks again (from any thread).
    pub(super) fn wake(&self) {
        self.kicked.store(true, SeqCst);
        if let Some(w) = lock(&self.waker).take() {
            w.wake();
        }
    }

    /// Waits (idle) until `cond` holds; every verb re-checks it. The waker is left before
    /// `cond` is read, so a verb on another thread between the two is not missed.
    pub(super) async fn wait_until(&self, cond: impl Fn() -> bool) {
        self.idle.store(true, SeqCst);
        std::future::poll_fn(|cx| {
            *lock(&self.waker) = Some(cx.waker().clone());
            if cond() {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await;
        self.unpark();
    }

    /// Where a pause takes effect: paused (standby when ready) until resumed or
    /// cancelled, then back to the state before. A pause on a thread the job's node left
    /// ends early, still paused: the loop moves and pauses on again there.
    pub async fn pause_point(&self) {
        if !self.pausing() {
            self.end_carried_pause();
            return;
        }
        // Paused on the thread the node left: the state to go back to came along.
        let kept = lock(&self.resume_to).take();
        let before = kept.unwrap_or_else(|| self.status());
        if kept.is_none() {
            self.set(if before == JobStatus::Ready {
                JobStatus::Standby
            } else {
                JobStatus::Paused
            });
        }
        self.wait_until(|| !self.pausing() || self.loop_moved())
            .await;
        if self.pausing() {
            // Still paused (not busy) while the loop moves.
            self.idle.store(true, SeqCst);
            *lock(&self.resume_to) = Some(before);
            return;
        }
        self.unpause(before);
    }

    /// A pause carried to a new thread is over (resumed or cancelled meanwhile, or the
    /// loop ended): back to the state before it, as a resume would (a cancelled paused
    /// job goes through running, as QEMU's).
    pub(crate) fn end_carried_pause(&self) {
        if let Some(before) = lock(&self.resume_to).take() {
            self.unpause(before);
        }
    }

    /// Resumed: back to the state before the pause.
    fn unpause(&self, before: JobStatus) {
        self.io_failed.store(false, SeqCst);
        self.set(before);
    }

    /// The job's loop now runs where `stay` says (None: it is not running).
    pub(crate) fn set_stay(&self, stay: Option<Stay>) {
        *lock(&self.stay) = stay;
    }

    /// Whether the node the job's loop runs for was moved to another thread.
    fn loop_moved(&self) -> bool {
        lock(&self.stay).as_ref().is_some_and(Stay::moved)
    }

    /// Sleeps `d`, then a pause point. Any verb since the last sleep or step
    /// ([`ratelimit`](Self::ratelimit)) cuts it short, so a verb on the main loop between
    /// the caller's look at the job and the sleep is not missed; the sleep takes it.
    pub async fn sleep(&self, d: Duration) {
        if self.is_cancelled() {
            return;
        }
        if self.pause_count() == 0 {
            self.idle.store(true, SeqCst);
            let mut s = std::pin::pin!(stord_aio::sleep(d));
            std::future::poll_fn(|cx| {
                *lock(&self.waker) = Some(cx.waker().clone());
                if self.kicked.load(SeqCst)
                    || self.is_cancelled()
                    || self.pause_count() > 0
                    || s.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(());
                }
                Poll::Pending
            })
            .await;
            self.kicked.store(false, SeqCst);
            self.unpark();
        }
        self.pause_point().await;
    }

    /// Done waiting: busy again, and the waker left for verbs goes (a verb later must not
    /// wake this task when it waits on something else, such as its loop's result).
    fn unpark(&self) {
        self.idle.store(false, SeqCst);
        lock(&self.waker).take();
    }

    /// Counts `n` bytes against the speed limit.
    pub fn ratelimit_processed(&self, n: u64) {
        lock(&self.limit).delay(n);
    }

    /// Between steps: waits as long as the speed limit asks (yielding to the loop even
    /// when it asks nothing), then a pause point.
    pub async fn ratelimit(&self) {
        // Before the delay is read: a speed change after it cuts the sleep short.
        self.kicked.store(false, SeqCst);
        let d = lock(&self.limit).delay(0);
        if d.is_zero() {
            stord_aio::yield_now().await;
            self.pause_point().await;
        } else {
            self.sleep(d).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::Events;
    use crate::job::options::JobOptions;
    use crate::job::table::Jobs;
    use std::rc::Rc;
    use std::time::Instant;

    #[test]
    fn a_verb_between_the_jobs_look_and_its_sleep_cuts_the_sleep_short() {
        let ctx = stord_aio::AioContext::new(Default::default()).unwrap();
        let events = Events::default();
        let jobs = Jobs::default();
        let looked = Rc::new(std::cell::Cell::new(false));
        let looked2 = looked.clone();
        jobs.start(
            "k",
            "create",
            JobOptions::plain(true, false),
            &events,
            move |job| async move {
                job.ratelimit().await;
                // The job has looked at its state; the verb lands before it sleeps.
                looked2.set(true);
                stord_aio::yield_now().await;
                let t0 = Instant::now();
                job.sleep(Duration::from_secs(2)).await;
                match t0.elapsed() < Duration::from_secs(1) {
                    true => Ok(None),
                    false => Err("slept through the verb".into()),
                }
            },
        )
        .unwrap();
        let job = jobs.get("k").unwrap();
        let j = jobs.clone();
        ctx.block_on(async move {
            while !looked.get() {
                stord_aio::yield_now().await;
            }
            j.set_speed(&job, 0).unwrap();
            while job.status() != JobStatus::Concluded {
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
        });
        assert_eq!(jobs.query()[0]["status"], "concluded");
        assert_eq!(jobs.query()[0].get("error"), None, "{}", jobs.query());
    }
}
