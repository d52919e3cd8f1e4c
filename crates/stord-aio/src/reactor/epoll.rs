//! The epoll reactor: the fallback when io_uring is unavailable, and the second reactor
//! every test runs on.
//!
//! Fd handlers are level-triggered epoll registrations. Operations that the ring would run
//! asynchronously are run synchronously (file I/O) or retried on readiness (sockets,
//! poll-add): a readiness *waiter* registers a dup of the fd with EPOLLONESHOT, so it never
//! collides with an fd handler on the same fd (epoll keys registrations by fd number).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::task::{Context, Poll, Waker};

use super::{Event, ReactorInfo, Reaped, TAG_FD, TAG_NOTIFIER, TAG_WAITER};
use crate::slab::{Key, Slab};
use crate::sys;

struct Waiter {
    fd: OwnedFd,
    waker: Option<Waker>,
    fired: Option<u32>,
}

pub(crate) struct EpollReactor {
    epfd: OwnedFd,
    fds: HashMap<Key, RawFd>,
    waiters: Slab<Waiter>,
    events: Vec<libc::epoll_event>,
    fallback_reason: Option<String>,
}

fn poll_to_epoll(events: u32) -> u32 {
    // POLLIN/POLLOUT/POLLPRI have the same values as their EPOLL twins.
    events & (libc::POLLIN | libc::POLLOUT | libc::POLLPRI) as u32
}

impl EpollReactor {
    pub(crate) fn new(notifier_fd: RawFd, fallback_reason: Option<String>) -> io::Result<Self> {
        let epfd = sys::epoll_create()?;
        sys::epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            notifier_fd,
            libc::EPOLLIN as u32,
            (TAG_NOTIFIER as u64) << 56,
        )?;
        Ok(Self {
            epfd,
            fds: HashMap::new(),
            waiters: Slab::default(),
            events: vec![libc::epoll_event { events: 0, u64: 0 }; 256],
            fallback_reason,
        })
    }

    pub(crate) fn info(&self) -> ReactorInfo {
        ReactorInfo {
            kind: "epoll",
            flags: Vec::new(),
            fallback_reason: self.fallback_reason.clone(),
        }
    }

    /// Fds are only seen through epoll_wait, so any watched fd means a syscall.
    pub(crate) fn need_wait(&self) -> bool {
        !self.fds.is_empty() || self.waiters.len() > 0
    }

    pub(crate) fn wait(&mut self, timeout_ns: Option<u64>, out: &mut Vec<Event>) -> Reaped {
        let n = match sys::epoll_wait_ns(self.epfd.as_raw_fd(), &mut self.events, timeout_ns) {
            Ok(n) => n,
            Err(e) => panic!("epoll wait failed: {e}"),
        };
        let mut notified = false;
        let mut peer = 0;
        for ev in &self.events[..n] {
            let (tag, key) = Key::from_token(ev.u64);
            match tag {
                TAG_FD if self.fds.contains_key(&key) => {
                    peer += 1;
                    out.push(Event::Fd {
                        key,
                        revents: ev.events,
                    });
                }
                TAG_WAITER => {
                    peer += 1;
                    if let Some(w) = self.waiters.get_mut(key) {
                        w.fired = Some(ev.events);
                        if let Some(waker) = w.waker.take() {
                            waker.wake();
                        }
                    }
                }
                TAG_NOTIFIER => notified = true,
                _ => {}
            }
        }
        // Storage operations ran synchronously when they were issued: none is reaped here.
        Reaped {
            completions: n,
            storage: 0,
            peer,
            notified,
        }
    }

    pub(crate) fn add_fd(&mut self, fd: RawFd, events: u32, key: Key) -> io::Result<()> {
        sys::epoll_ctl(
            self.epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            fd,
            poll_to_epoll(events),
            key.to_token(TAG_FD),
        )?;
        self.fds.insert(key, fd);
        Ok(())
    }

    pub(crate) fn remove_fd(&mut self, key: Key) {
        if let Some(fd) = self.fds.remove(&key) {
            let _ = sys::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, 0, 0);
        }
    }

    /// Registers a one-shot readiness waiter for `events` (poll bits) on `fd`.
    pub(crate) fn add_waiter(&mut self, fd: RawFd, events: u32) -> io::Result<Key> {
        let dup = sys::dup(fd)?;
        let raw = dup.as_raw_fd();
        let key = self.waiters.insert(Waiter {
            fd: dup,
            waker: None,
            fired: None,
        });
        if let Err(e) = sys::epoll_ctl(
            self.epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            raw,
            poll_to_epoll(events) | libc::EPOLLONESHOT as u32,
            key.to_token(TAG_WAITER),
        ) {
            self.waiters.remove(key);
            return Err(e);
        }
        Ok(key)
    }

    /// Polls a waiter: `Ready(revents)` once it fired; the waiter is then gone.
    pub(crate) fn poll_waiter(&mut self, key: Key, cx: &mut Context<'_>) -> Poll<u32> {
        match self.waiters.get_mut(key) {
            Some(Waiter {
                fired: Some(ev), ..
            }) => {
                let ev = *ev;
                self.remove_waiter(key);
                Poll::Ready(ev)
            }
            Some(w) => {
                w.waker = Some(cx.waker().clone());
                Poll::Pending
            }
            None => panic!("polled an unknown epoll waiter"),
        }
    }

    pub(crate) fn remove_waiter(&mut self, key: Key) {
        if let Some(w) = self.waiters.remove(key) {
            let _ = sys::epoll_ctl(
                self.epfd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                w.fd.as_raw_fd(),
                0,
                0,
            );
        }
    }
}
