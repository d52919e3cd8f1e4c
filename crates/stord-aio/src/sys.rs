//! Thin, safe wrappers over the few raw system calls the loop needs.
//!
//! Every `unsafe` block of the crate that is a plain syscall lives here, so that the rest
//! of the loop is safe code. Each wrapper turns `-1`/`errno` into `io::Error`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

fn cvt(ret: libc::c_long) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Monotonic clock in nanoseconds (CLOCK_MONOTONIC).
pub fn now_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU time consumed by the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes to it.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The kernel thread id of the calling thread (what QEMU reports as `thread-id`).
pub fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// sched_yield(2): lets another runnable thread on this CPU run (returns at once if none).
pub fn yield_cpu() {
    // SAFETY: no arguments, no memory.
    unsafe { libc::sched_yield() };
}

/// Asks the fair scheduler for a `slice_ns` time slice for the calling thread
/// (sched_setattr(2)'s `sched_runtime`, a custom slice since Linux 6.12; 0 goes back to
/// the kernel's default). Keeps the thread's policy, nice value and reset-on-fork flag; a
/// thread in any other policy than SCHED_OTHER or SCHED_BATCH (real-time, deadline,
/// SCHED_IDLE) is left as it is (returns false).
pub fn set_sched_slice(slice_ns: u64) -> io::Result<bool> {
    let mut attr = sched_getattr()?;
    let policy = attr.sched_policy as libc::c_int;
    if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
        return Ok(false);
    }
    attr.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    attr.sched_runtime = slice_ns;
    // SAFETY: `attr` is a valid sched_attr of `attr.size` bytes that the kernel only reads.
    cvt(unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr, 0) })?;
    Ok(true)
}

/// The calling thread's fair-scheduler slice as sched_getattr(2) reports it: the one
/// [`set_sched_slice`] asked for, or the kernel's default.
pub fn sched_slice() -> io::Result<u64> {
    Ok(sched_getattr()?.sched_runtime)
}

fn sched_getattr() -> io::Result<libc::sched_attr> {
    let size = std::mem::size_of::<libc::sched_attr>() as u32;
    let mut attr = libc::sched_attr {
        size,
        sched_policy: 0,
        sched_flags: 0,
        sched_nice: 0,
        sched_priority: 0,
        sched_runtime: 0,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: `attr` is a writable sched_attr of `size` bytes; the kernel writes at most
    // `size` bytes into it. Pid 0 is the calling thread.
    cvt(unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr, size, 0) })?;
    attr.size = size;
    Ok(attr)
}

/// A non-blocking, close-on-exec eventfd.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd counter.
pub fn eventfd_write(fd: RawFd) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: the buffer is a live u64 of exactly the 8 bytes passed.
    let r = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    cvt(r as libc::c_long).map(|_| ())
}

/// Reads and resets an eventfd counter; `Ok(0)` when it was already zero.
pub fn eventfd_read(fd: RawFd) -> io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: the buffer is a live, writable u64 of exactly the 8 bytes passed.
    let r = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    match cvt(r as libc::c_long) {
        Ok(_) => Ok(v),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        Err(e) => Err(e),
    }
}

/// `epoll_create1(EPOLL_CLOEXEC)`.
pub fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: no pointers; result checked.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `epoll_ctl` with `data` as the event's user data.
pub fn epoll_ctl(
    epfd: RawFd,
    op: libc::c_int,
    fd: RawFd,
    events: u32,
    data: u64,
) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: data };
    // SAFETY: `ev` is a valid epoll_event that outlives the call.
    let r = unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) };
    cvt(r as libc::c_long).map(|_| ())
}

/// Set once epoll_pwait2 answered ENOSYS (kernels before 5.11, valgrind).
static NO_EPOLL_PWAIT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Waits for events with a nanosecond timeout (`None` = forever) via epoll_pwait2, or
/// epoll_wait with the timeout rounded up to a millisecond where epoll_pwait2 is missing.
/// EINTR is reported as zero events.
pub fn epoll_wait_ns(
    epfd: RawFd,
    events: &mut [libc::epoll_event],
    timeout_ns: Option<u64>,
) -> io::Result<usize> {
    use std::sync::atomic::Ordering::Relaxed;
    if NO_EPOLL_PWAIT2.load(Relaxed) {
        return epoll_wait_ms(epfd, events, timeout_ns);
    }
    let ts;
    let tsp = match timeout_ns {
        None => std::ptr::null(),
        Some(ns) => {
            ts = libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            };
            &ts as *const libc::timespec
        }
    };
    // SAFETY: `events` is a writable array of the length passed; `tsp` is null or points
    // to `ts`, which lives until the end of this function; no signal mask is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait2,
            epfd,
            events.as_mut_ptr(),
            events.len() as libc::c_int,
            tsp,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    match cvt(r) {
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(0),
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            NO_EPOLL_PWAIT2.store(true, Relaxed);
            epoll_wait_ms(epfd, events, timeout_ns)
        }
        other => other,
    }
}

/// epoll_wait, the timeout rounded up to whole milliseconds (`None` = forever).
fn epoll_wait_ms(
    epfd: RawFd,
    events: &mut [libc::epoll_event],
    timeout_ns: Option<u64>,
) -> io::Result<usize> {
    let ms = timeout_ns.map_or(-1, |ns| ns.div_ceil(1_000_000).min(i32::MAX as u64) as i32);
    // SAFETY: `events` is a writable array of the length passed.
    let r = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), events.len() as i32, ms) };
    match cvt(r as libc::c_long) {
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(0),
        other => other,
    }
}

/// `dup(fd)` with close-on-exec, as an owned fd.
pub fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: no pointers; result checked.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// `poll(2)` on one fd with a zero timeout: the ready events, or 0.
pub fn poll_now(fd: RawFd, events: i16) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd, timeout 0.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    cvt(r as libc::c_long).map(|_| p.revents)
}

/// Converts a raw syscall return into the io_uring convention (`-errno` on failure).
fn neg_errno(r: libc::c_long) -> i32 {
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        r as i32
    }
}

/// The synchronous forms of the ring's operations, used by the epoll reactor. They all
/// return what the matching io_uring CQE would hold: a count or `-errno`.
pub mod blocking {
    use super::*;

    /// pread(2) into `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be writable memory owned by the caller for the call's duration.
    pub unsafe fn pread(fd: RawFd, ptr: *mut u8, len: usize, off: u64) -> i32 {
        // SAFETY: the caller guarantees the buffer; the kernel writes at most `len` bytes.
        neg_errno(unsafe { libc::pread(fd, ptr.cast(), len, off as libc::off_t) } as libc::c_long)
    }

    /// preadv2(2).
    ///
    /// # Safety
    /// Every iovec must describe writable memory owned by the caller for the call.
    pub unsafe fn preadv(fd: RawFd, iov: &[libc::iovec], off: u64, flags: i32) -> i32 {
        // SAFETY: as the caller guarantees, each iovec names live writable memory.
        neg_errno(unsafe {
            libc::preadv2(
                fd,
                iov.as_ptr(),
                iov.len() as i32,
                off as libc::off_t,
                flags,
            )
        } as libc::c_long)
    }

    /// pwritev2(2).
    ///
    /// # Safety
    /// Every iovec must describe readable memory owned by the caller for the call.
    pub unsafe fn pwritev(fd: RawFd, iov: &[libc::iovec], off: u64, flags: i32) -> i32 {
        // SAFETY: as the caller guarantees, each iovec names live readable memory.
        neg_errno(unsafe {
            libc::pwritev2(
                fd,
                iov.as_ptr(),
                iov.len() as i32,
                off as libc::off_t,
                flags,
            )
        } as libc::c_long)
    }

    /// fsync(2) or fdatasync(2).
    pub fn fsync(fd: RawFd, datasync: bool) -> i32 {
        // SAFETY: no pointers.
        let r = unsafe {
            if datasync {
                libc::fdatasync(fd)
            } else {
                libc::fsync(fd)
            }
        };
        neg_errno(r as libc::c_long)
    }

    /// fallocate(2).
    pub fn fallocate(fd: RawFd, mode: i32, off: u64, len: u64) -> i32 {
        // SAFETY: no pointers.
        let r = unsafe { libc::fallocate(fd, mode, off as libc::off_t, len as libc::off_t) };
        neg_errno(r as libc::c_long)
    }

    /// recv(2) with MSG_DONTWAIT added.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be writable memory owned by the caller for the call's duration.
    pub unsafe fn recv(fd: RawFd, ptr: *mut u8, len: usize, flags: i32) -> i32 {
        // SAFETY: the caller guarantees the buffer.
        let r = unsafe { libc::recv(fd, ptr.cast(), len, flags | libc::MSG_DONTWAIT) };
        neg_errno(r as libc::c_long)
    }

    /// send(2) with MSG_DONTWAIT and MSG_NOSIGNAL added.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be readable memory owned by the caller for the call's duration.
    pub unsafe fn send(fd: RawFd, ptr: *const u8, len: usize, flags: i32) -> i32 {
        // SAFETY: the caller guarantees the buffer.
        neg_errno(unsafe {
            libc::send(
                fd,
                ptr.cast(),
                len,
                flags | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        } as libc::c_long)
    }
}

/// writev(2) of borrowed slices, with MSG_DONTWAIT semantics if the fd is non-blocking:
/// returns the count written, or WouldBlock.
pub fn writev_now(fd: RawFd, bufs: &[&[u8]]) -> io::Result<usize> {
    writev_iter(fd, bufs.iter().copied())
}

/// [`writev_now`] of the slices an iterator yields: at most IOV_MAX (1024) of them go
/// out, the first [`STACK_IOVECS`] without an allocation (a reply batch is a few).
pub fn writev_iter<'a>(fd: RawFd, bufs: impl Iterator<Item = &'a [u8]>) -> io::Result<usize> {
    let iovec = |b: &[u8]| libc::iovec {
        iov_base: b.as_ptr() as *mut _,
        iov_len: b.len(),
    };
    let mut on_stack = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; STACK_IOVECS];
    let mut on_heap: Vec<libc::iovec> = Vec::new();
    let mut n = 0;
    for b in bufs.take(1024) {
        if n < STACK_IOVECS {
            on_stack[n] = iovec(b);
        } else {
            if on_heap.is_empty() {
                on_heap.extend_from_slice(&on_stack);
            }
            on_heap.push(iovec(b));
        }
        n += 1;
    }
    let iov: &[libc::iovec] = if n <= STACK_IOVECS {
        &on_stack[..n]
    } else {
        &on_heap
    };
    // SAFETY: every iovec points into a slice borrowed for the duration of this call.
    let r = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as i32) };
    cvt(r as libc::c_long)
}

/// Slices [`writev_iter`] takes without allocating.
pub const STACK_IOVECS: usize = 16;

/// CPU time (user + system) used so far by thread `tid` of this process, in nanoseconds,
/// from /proc/self/task/TID/schedstat (nanosecond resolution).
pub fn task_cpu_ns(tid: i32) -> io::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))?;
    s.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad schedstat"))
}

/// Borrows the raw fd of anything that has one (for the wrappers above).
pub fn raw<F: AsRawFd>(f: &F) -> RawFd {
    f.as_raw_fd()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    /// The fallback for kernels without epoll_pwait2 rounds a timeout up, never down to a
    /// busy zero-timeout wait, and still reports ready fds.
    #[test]
    fn epoll_wait_ms_rounds_timeouts_up_and_sees_events() {
        let ep = epoll_create().unwrap();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 4];
        let t = Instant::now();
        assert_eq!(
            epoll_wait_ms(ep.as_raw_fd(), &mut events, Some(1_500_000)).unwrap(),
            0
        );
        assert!(t.elapsed() >= Duration::from_millis(2), "{:?}", t.elapsed());

        let efd = eventfd().unwrap();
        epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            efd.as_raw_fd(),
            libc::EPOLLIN as u32,
            7,
        )
        .unwrap();
        eventfd_write(efd.as_raw_fd()).unwrap();
        assert_eq!(epoll_wait_ms(ep.as_raw_fd(), &mut events, None).unwrap(), 1);
        assert_eq!({ events[0].u64 }, 7);
    }
}
