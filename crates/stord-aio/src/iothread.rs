//! `IoThread`: a named thread that owns one `AioContext` and runs it until stopped.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::context::{AioContext, AioContextOptions};
use crate::remote::Remote;

/// A thread running an event loop. Dropping it stops and joins it.
pub struct IoThread {
    remote: Remote,
    handle: Option<JoinHandle<()>>,
}

impl IoThread {
    /// Starts a thread named `opts.name` whose context is built with `opts`; returns once
    /// the context exists (so its reactor choice and thread id are known).
    pub fn spawn(opts: AioContextOptions) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(1);
        let name = if opts.name.is_empty() {
            "iothread".to_string()
        } else {
            opts.name.clone()
        };
        // Linux thread names are at most 15 bytes.
        let thread_name: String = name.chars().take(15).collect();
        let handle = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let ctx = match AioContext::new(opts) {
                    Ok(ctx) => ctx,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(Ok(ctx.remote()));
                ctx.run_until_stopped();
            })?;
        match rx.recv() {
            Ok(Ok(remote)) => Ok(Self {
                remote,
                handle: Some(handle),
            }),
            Ok(Err(e)) => {
                let _ = handle.join();
                Err(e)
            }
            Err(_) => {
                let _ = handle.join();
                Err(io::Error::other("iothread died during start-up"))
            }
        }
    }

    /// The handle to its context.
    pub fn remote(&self) -> &Remote {
        &self.remote
    }

    /// Asks the loop to stop and joins the thread.
    pub fn stop(&mut self) {
        self.remote.shared.stopping.store(true, Ordering::Release);
        self.remote.notify();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }

    /// Whether the thread is still running.
    pub fn is_running(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.is_finished())
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        self.stop();
    }
}
