//! A job's loop on its node's thread: [`Home::drive`] runs the loop as a task on the
//! thread that serves the node (QEMU's job coroutine in its node's AioContext) and gives
//! back its result; [`follow`] runs it again from where it stopped each time the node
//! moves to another IoThread, a paused loop too ([`Stay`] tells it the node moved).
//!
//! [`Home::drive`] is written here, beside [`follow`], rather than with [`Home`]: it waits
//! for the loop through [`InFlight`], which starts its operations on a [`Home`].

use std::future::Future;
use std::sync::Arc;

use super::handle::Job;
use super::home::Home;
use super::in_flight::{stopped, InFlight};
use super::stay::Stay;
use crate::block::node::block_node::BlockNode;

impl Home {
    /// Runs a job's loop, the future `make` builds, as a task on this thread (QEMU's job
    /// coroutine in its node's AioContext), and waits for what it returns: `lost` if the
    /// thread stops first. The result travels back through the waiting loop's queue,
    /// behind the events the loop posted there, so they go out before the job concludes
    /// (a result handed over in shared memory could be seen before them).
    pub async fn drive<T, F, Fut>(&self, lost: T, make: F) -> T
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let ops = InFlight::new();
        let mut slot = ops.slot(0, lost);
        // The result is given back on the waiting loop, through its queue: anything the
        // loop posted there before (its events) has run by then.
        let back = stord_aio::with_current_context(|c| c.remote());
        self.spawn(move || async move {
            // Where jobs' loops ran, in the loop's statistics (`x-stats`).
            stord_aio::with_current_context(|l| l.counter("job.loops").add(1));
            let r = make().await;
            match back {
                Some(back) if !back.is_current() => back.call(move || slot.give(r)),
                _ => slot.give(r),
            }
        });
        match ops.next().await {
            Some(r) => r,
            None => unreachable!("a started operation gives a result or its lost one"),
        }
    }
}

/// How a job's loop on its node's thread ended.
pub enum Step<T, S> {
    /// The loop's own end.
    Done(T),
    /// The node moved: the loop goes on from `S` on its new thread.
    Moved(S),
}

/// Where a job's node is served now; None when that cannot be looked up just now (the
/// daemon's state is in use by a command that waits).
pub type FindHome<'a> = &'a dyn Fn() -> Option<Home>;

/// Runs `job`'s loop (`run`, from its place `at`) on the thread that serves `node`
/// ([`Home::drive`]), and again from where it stopped on the new thread each time the
/// node moves (a paused loop too: its pause ends there and goes on on the new thread).
/// Err: the job fails (also when the loop's thread stopped under it).
pub async fn follow<S, T, F, Fut>(
    job: &Job,
    node: &Arc<BlockNode>,
    home: FindHome<'_>,
    mut at: S,
    run: F,
) -> Result<T, String>
where
    S: Send + 'static,
    T: Send + 'static,
    F: FnOnce(S, Stay, Home) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Step<T, S>, String>> + 'static,
{
    let mut looked = 0;
    loop {
        let here = match home() {
            Some(here) => here,
            // Look again shortly rather than settle on the main loop: for a second at
            // most, and not for a cancelled job (its loop only has to see the cancel).
            None if looked < 100 && !job.is_cancelled() => {
                looked += 1;
                stord_aio::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
            None => Home::Main,
        };
        looked = 0;
        let stay = Stay::new(node);
        job.set_stay(Some(stay.clone()));
        let (run, there) = (run.clone(), here.clone());
        let lost = Err(stopped().to_string());
        let step = here.drive(lost, move || run(at, stay, there)).await;
        job.set_stay(None);
        let ended = match step {
            Ok(Step::Moved(moved)) => {
                at = moved;
                continue;
            }
            Ok(Step::Done(t)) => Ok(t),
            Err(e) => Err(e),
        };
        // Ended on the way (cancelled, or its thread stopped): a pause it carried is over.
        job.end_carried_pause();
        return ended;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::handle::lock;
    use std::io;
    use std::sync::Mutex;
    use stord_aio::{AioContext, AioContextOptions, IoThread};

    #[test]
    fn an_operation_whose_thread_stopped_comes_back_as_lost() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let mut t = IoThread::spawn(AioContextOptions::default()).unwrap();
        let home = Home::IoThread(t.remote().clone());
        t.stop();
        let r = ctx.block_on(async move {
            home.drive(Err(stopped()), || async { Ok::<_, io::Error>(1) })
                .await
        });
        assert_eq!(r.unwrap_err().to_string(), "the IoThread stopped");
    }

    #[test]
    fn a_loop_driven_on_an_iothread_has_its_events_out_before_its_result_is_back() {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let mut t = IoThread::spawn(AioContextOptions::default()).unwrap();
        let events = crate::events::Events::default();
        let seen = crate::events::Recorder::listen(&events);
        let poster = events.poster().unwrap();
        let home = Home::IoThread(t.remote().clone());
        let main = std::thread::current().id();
        let seen2 = seen.clone();
        let (ran_on, seen_then) = ctx.block_on(async move {
            let ran_on = home
                .drive(main, move || async move {
                    for n in 0..200 {
                        poster
                            .emit_here_or_post("JOB_STATUS_CHANGE", serde_json::json!({ "n": n }));
                        if n % 50 == 0 {
                            stord_aio::yield_now().await;
                        }
                    }
                    std::thread::current().id()
                })
                .await;
            (ran_on, seen2.got.borrow().len())
        });
        assert_ne!(ran_on, main, "the loop ran on the IoThread");
        assert_eq!(
            seen_then, 200,
            "every event was out when the result came back"
        );
        let order: Vec<u64> = seen
            .got
            .borrow()
            .iter()
            .map(|e| e["data"]["n"].as_u64().unwrap())
            .collect();
        assert_eq!(order, (0..200).collect::<Vec<u64>>());
        t.stop();
    }

    /// Runs `follow` in job `j` on this thread's loop, with the loop `run` makes for the
    /// job, while `meanwhile` runs beside it: what `follow` gave.
    fn follow_in_a_job<S, T, F, Fut>(
        ctx: &AioContext,
        jobs: &crate::job::Jobs,
        events: &crate::events::Events,
        node: &Arc<BlockNode>,
        home: impl Fn() -> Option<Home> + 'static,
        run: impl FnOnce(Arc<Job>) -> F + 'static,
        meanwhile: impl Future<Output = ()> + 'static,
    ) -> Result<T, String>
    where
        S: Default + Send + 'static,
        T: Send + 'static,
        F: FnOnce(S, Stay, Home) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<Step<T, S>, String>> + 'static,
    {
        let got = std::rc::Rc::new(std::cell::RefCell::new(None));
        let (g, node) = (got.clone(), node.clone());
        jobs.start(
            "j",
            "create",
            crate::job::JobOptions::plain(true, true),
            events,
            move |job| async move {
                let r = follow(&job, &node, &home, S::default(), run(job.clone())).await;
                *g.borrow_mut() = Some(r);
                Ok(None)
            },
        )
        .unwrap();
        let g = got.clone();
        let start = std::time::Instant::now();
        ctx.block_on(async move {
            meanwhile.await;
            while g.borrow().is_none() {
                assert!(
                    start.elapsed() < std::time::Duration::from_secs(20),
                    "never ended"
                );
                stord_aio::sleep(std::time::Duration::from_millis(1)).await;
            }
        });
        got.take().unwrap()
    }

    /// A loop, two IoThreads, a node on the first ("io1"), and where the node is served
    /// now: "io1" the first thread, any other name the second.
    fn two_threads_and_a_node() -> (
        AioContext,
        IoThread,
        IoThread,
        Arc<BlockNode>,
        impl Fn() -> Home + Clone,
    ) {
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let t1 = IoThread::spawn(AioContextOptions::default()).unwrap();
        let t2 = IoThread::spawn(AioContextOptions::default()).unwrap();
        let (r1, r2) = (t1.remote().clone(), t2.remote().clone());
        let node = crate::block::drivers::null::test_node("n");
        node.set_home(Some("io1".into()));
        let n = node.clone();
        let serving = move || match n.home().as_deref() {
            Some("io1") => Home::IoThread(r1.clone()),
            Some(_) => Home::IoThread(r2.clone()),
            None => Home::Main,
        };
        (ctx, t1, t2, node, serving)
    }

    #[test]
    fn a_loop_follows_its_node_to_another_iothread_from_where_it_was() {
        use std::thread::ThreadId;
        let (ctx, mut t1, mut t2, node, serving) = two_threads_and_a_node();
        // The first look finds no thread (as when the daemon's state is busy): the loop
        // waits for one rather than run on the main loop.
        let looks = std::cell::Cell::new(0);
        let home = move || {
            looks.set(looks.get() + 1);
            (looks.get() > 1).then(&serving)
        };
        let moving = node.clone();
        // Ten steps; at the fourth the node moves to io2.
        let run = move |mut at: Vec<ThreadId>, stay: Stay, _here: Home| async move {
            while at.len() < 10 {
                if stay.moved() {
                    return Ok(Step::Moved(at));
                }
                at.push(std::thread::current().id());
                if at.len() == 4 {
                    moving.set_home(Some("io2".into()));
                }
                stord_aio::yield_now().await;
            }
            Ok(Step::Done(at))
        };
        let (jobs, events) = (
            crate::job::Jobs::default(),
            crate::events::Events::default(),
        );
        let ran_on = follow_in_a_job(&ctx, &jobs, &events, &node, home, |_| run, async {}).unwrap();
        let main = std::thread::current().id();
        assert_eq!(ran_on.len(), 10);
        assert!(ran_on[..4].iter().all(|t| *t == ran_on[0]) && ran_on[0] != main);
        assert!(ran_on[4..].iter().all(|t| *t == ran_on[4]) && ran_on[4] != main);
        assert_ne!(
            ran_on[0], ran_on[4],
            "the loop went on on the node's new thread"
        );
        t1.stop();
        t2.stop();
    }

    #[test]
    fn a_job_cancelled_while_its_thread_cannot_be_looked_up_ends_at_once() {
        use std::time::{Duration, Instant};
        let ctx = AioContext::new(AioContextOptions::default()).unwrap();
        let node = crate::block::drivers::null::test_node("n");
        let (jobs, events) = (
            crate::job::Jobs::default(),
            crate::events::Events::default(),
        );
        let run = |job: Arc<Job>| {
            move |(): (), _stay: Stay, _here: Home| async move {
                while !job.is_cancelled() {
                    job.ratelimit().await;
                }
                Ok(Step::Done(()))
            }
        };
        let j = jobs.clone();
        let meanwhile = async move {
            stord_aio::sleep(Duration::from_millis(20)).await;
            let job = j.find("j", false).unwrap();
            j.cancel(&job, true).unwrap();
        };
        let start = Instant::now();
        follow_in_a_job(&ctx, &jobs, &events, &node, || None, run, meanwhile).unwrap();
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "waited out the look-up: {:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_paused_loop_follows_its_node_and_the_thread_it_left_can_go() {
        paused_loop_moves(Then::ResumeOnIo2);
    }

    #[test]
    fn a_job_resumed_as_its_paused_loop_moves_runs_on() {
        paused_loop_moves(Then::ResumeInTransit);
    }

    #[test]
    fn a_job_cancelled_as_its_paused_loop_leaves_goes_through_running() {
        paused_loop_moves(Then::CancelAsItLeaves);
    }

    /// What follows the move of a paused job's node from io1 to io2.
    #[derive(Clone, Copy, PartialEq)]
    enum Then {
        /// Resumed once its loop is paused on io2 and io1 has stopped.
        ResumeOnIo2,
        /// Resumed while its loop is between the two threads (as its next thread is
        /// looked up).
        ResumeInTransit,
        /// Cancelled as its loop, its pause ended by the move, is about to leave io1.
        CancelAsItLeaves,
    }

    /// A job paused, its node moved from io1 to io2, then `then`.
    fn paused_loop_moves(then: Then) {
        let in_transit = then == Then::ResumeInTransit;
        use std::thread::ThreadId;
        use std::time::Duration;
        let (ctx, mut t1, mut t2, node, serving) = two_threads_and_a_node();
        let (jobs, events) = (
            crate::job::Jobs::default(),
            crate::events::Events::default(),
        );
        let (resumer, n) = (jobs.clone(), node.clone());
        let home = move || {
            if in_transit && n.home().as_deref() == Some("io2") {
                let job = resumer.find("j", false).unwrap();
                let _ = resumer.resume(&job);
            }
            Some(serving())
        };
        let seen = crate::events::Recorder::listen(&events);
        let steps = Arc::new(Mutex::new(0usize));
        let counted = steps.clone();
        // Forty steps of 2 ms, each after a pause point.
        let run = move |job: Arc<Job>| {
            move |mut at: Vec<ThreadId>, stay: Stay, _here: Home| {
                let counted = counted.clone();
                async move {
                    while at.len() < 40 {
                        job.ratelimit().await;
                        if then == Then::CancelAsItLeaves && lock(&job.resume_to).is_some() {
                            job.cancel(true).unwrap();
                        }
                        if job.is_cancelled() {
                            return Ok(Step::Done(at));
                        }
                        if stay.moved() {
                            return Ok(Step::Moved(at));
                        }
                        // A step runs only with the job shown running.
                        assert_eq!(job.status(), crate::job::JobStatus::Running);
                        at.push(std::thread::current().id());
                        *counted.lock().unwrap() += 1;
                        stord_aio::sleep(Duration::from_millis(2)).await;
                    }
                    Ok(Step::Done(at))
                }
            }
        };
        let step_count = move || *steps.lock().unwrap();
        async fn until(cond: impl Fn() -> bool) {
            let start = std::time::Instant::now();
            while !cond() {
                assert!(start.elapsed() < Duration::from_secs(10), "timed out");
                stord_aio::sleep(Duration::from_millis(1)).await;
            }
        }
        let (j, moving) = (jobs.clone(), node.clone());
        let meanwhile = async move {
            let jobs = j;
            until(|| step_count() >= 5).await;
            let job = jobs.find("j", false).unwrap();
            jobs.pause(&job).unwrap();
            until(|| job.status() == crate::job::JobStatus::Paused).await;
            let paused_at = step_count();
            // The node moves while the job is paused, and the thread it left goes.
            moving.set_home(Some("io2".into()));
            jobs.node_moved();
            if then != Then::ResumeOnIo2 {
                return t1;
            }
            until(|| {
                lock(&job.stay)
                    .as_ref()
                    .is_some_and(|s| s.home.as_deref() == Some("io2"))
            })
            .await;
            t1.stop();
            stord_aio::sleep(Duration::from_millis(20)).await;
            assert_eq!(step_count(), paused_at, "a step ran while paused");
            assert_eq!(job.status(), crate::job::JobStatus::Paused);
            jobs.resume(&job).unwrap();
            t1
        };
        let t1 = std::rc::Rc::new(std::cell::RefCell::new(None));
        let keep = t1.clone();
        let meanwhile = async move {
            *keep.borrow_mut() = Some(meanwhile.await);
        };
        let ran_on = follow_in_a_job(&ctx, &jobs, &events, &node, home, run, meanwhile)
            .expect("the job went on on the node's new thread");
        if let Some(mut t1) = t1.take() {
            t1.stop();
        }
        let states = || -> Vec<String> {
            seen.got
                .borrow()
                .iter()
                .filter(|e| e["event"] == "JOB_STATUS_CHANGE")
                .map(|e| e["data"]["status"].as_str().unwrap().to_string())
                .collect()
        };
        if then == Then::CancelAsItLeaves {
            // Paused, then running again before it ends, as a cancelled paused job does.
            assert!(ran_on.len() < 40);
            let states = states();
            let paused = states.iter().position(|s| s == "paused").unwrap();
            assert_eq!(states[paused + 1], "running", "{states:?}");
            t2.stop();
            return;
        }
        assert_eq!(ran_on.len(), 40);
        let last = ran_on[39];
        assert_ne!(ran_on[0], last, "the steps after the pause ran on io2");
        assert!(ran_on.iter().all(|t| *t != std::thread::current().id()));
        // One pause, one resume, as when nothing moved.
        let states = states();
        let paused = states.iter().position(|s| s == "paused").unwrap();
        assert_eq!(
            states.iter().filter(|s| *s == "paused").count(),
            1,
            "{states:?}"
        );
        assert_eq!(states[paused + 1], "running", "{states:?}");
        t2.stop();
    }
}
