//! Safe wrappers for the few syscalls the daemon makes outside stord-aio.

use std::io;
use std::os::fd::RawFd;

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// fallocate(2).
pub fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall; no pointers.
    check(unsafe { libc::fallocate(fd, mode, offset as i64, len as i64) })
}

/// lseek(2); returns the new offset.
pub fn lseek(fd: RawFd, offset: u64, whence: i32) -> io::Result<u64> {
    // SAFETY: plain syscall; no pointers.
    let r = unsafe { libc::lseek(fd, offset as i64, whence) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as u64)
    }
}

/// ftruncate(2).
pub fn ftruncate(fd: RawFd, size: u64) -> io::Result<()> {
    // SAFETY: plain syscall; no pointers.
    check(unsafe { libc::ftruncate(fd, size as i64) })
}

/// shutdown(2) both directions; errors are ignored (the peer may be gone).
pub fn shutdown(fd: RawFd) {
    // SAFETY: plain syscall; no pointers.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and threads it creates later)
/// and returns a non-blocking signalfd that reports them.
pub fn signalfd_for_shutdown() -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `set` is a local sigset_t initialised by sigemptyset before use; the calls
    // only read and write it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        check(libc::pthread_sigmask(
            libc::SIG_BLOCK,
            &set,
            std::ptr::null_mut(),
        ))?;
        let fd = libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(std::os::fd::OwnedFd::from_raw_fd(fd))
    }
}

/// Reads one pending signal number from a signalfd, if any.
pub fn read_signal(fd: RawFd) -> Option<u32> {
    // SAFETY: a zeroed signalfd_siginfo is a valid value; read writes at most its size.
    unsafe {
        let mut info: libc::signalfd_siginfo = std::mem::zeroed();
        let n = libc::read(
            fd,
            (&mut info as *mut libc::signalfd_siginfo).cast(),
            std::mem::size_of::<libc::signalfd_siginfo>(),
        );
        (n == std::mem::size_of::<libc::signalfd_siginfo>() as isize).then_some(info.ssi_signo)
    }
}

/// fork(2): `Ok(Some(pid))` in the parent, `Ok(None)` in the child. Call it before any
/// thread is started (the child only gets the calling thread).
pub fn fork() -> io::Result<Option<i32>> {
    // SAFETY: called while the process is single-threaded (before the daemon starts any
    // thread), so the child's copy of memory and locks is consistent.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        p => Ok(Some(p)),
    }
}

/// setsid(2): detach from the controlling terminal.
pub fn setsid() -> io::Result<()> {
    // SAFETY: no arguments.
    let r = unsafe { libc::setsid() };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Points stdin, stdout and stderr at /dev/null.
pub fn stdio_to_devnull() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors; `null` stays open for the call.
        check(unsafe { libc::dup2(null.as_raw_fd(), fd) })?;
    }
    Ok(())
}
