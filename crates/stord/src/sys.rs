//! Safe wrappers for the few syscalls the daemon makes outside stord-aio.

use std::io;
use std::os::fd::RawFd;

/// An I/O error as strerror words it, as QEMU's messages quote it (without Rust's
/// " (os error N)").
pub fn os_text(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

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

/// memfd_create(2) with MFD_CLOEXEC: anonymous shared memory to hand to another process.
pub fn memfd_create(name: &str) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new fd that nothing else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// accept4(2) of one pending connection, non-blocking and close-on-exec.
pub fn accept(listener: RawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: null address pointers are allowed (we do not want the peer's address).
    let fd = unsafe {
        libc::accept4(
            listener,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: accept4 returned a new descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Peeks at the start of the next message on a Unix stream socket without taking it
/// (recvmsg(2) with MSG_PEEK): fills `buf` with what has arrived, blocking until something
/// has. With `want_fd`, also returns a duplicate of the first descriptor passed with the
/// message (the kernel installs copies on a peek; any others are closed here), while the
/// reader that takes the message still gets the originals. Without it, passed
/// descriptors are not installed at all.
pub fn peek_message(
    fd: RawFd,
    buf: &mut [u8],
    want_fd: bool,
) -> io::Result<(usize, Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::{FromRawFd, OwnedFd};
    const MAX_FDS: usize = 8;
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8 + MAX_FDS];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if want_fd {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
    }
    // SAFETY: `msg` points at `iov` (covering `buf`) and at `control`, all alive for the
    // call; the kernel writes at most the lengths given.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_PEEK | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut first = None;
    if want_fd {
        // SAFETY: the CMSG_* walk stays within `msg.msg_controllen`, which the kernel set
        // to what it wrote into `control`; SCM_RIGHTS data is an array of descriptors,
        // new in this process and owned by nobody else.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / std::mem::size_of::<libc::c_int>();
                    for i in 0..count {
                        let fd = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                        if first.is_none() {
                            first = Some(fd);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
    }
    Ok((n as usize, first))
}

/// CPU time the calling thread has used (PBKDF2's iteration count is timed with it, as
/// QEMU times it).
pub fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; the clock always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
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

/// Makes `dst` a descriptor of the open file behind `src` (dup3 with close-on-exec): the
/// number stays, the old open file it held is released (and with it that description's
/// OFD locks).
pub fn dup_onto(src: RawFd, dst: RawFd) -> io::Result<()> {
    // SAFETY: dup3 takes two descriptor numbers; the caller owns `dst` and keeps it open.
    let r = unsafe { libc::dup3(src, dst, libc::O_CLOEXEC) };
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

/// Tells the service manager that started the process (systemd's `Type=notify`, which
/// stord@.service uses) that the daemon is ready: `READY=1` as a datagram to the socket
/// `NOTIFY_SOCKET` names (a path, or `@` and an abstract name). Without it, nothing.
pub fn notify_ready() -> io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let addr = match target.as_bytes().strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(&target)?,
    };
    UnixDatagram::unbound()?.send_to_addr(b"READY=1", &addr)?;
    Ok(())
}

/// `ioctl(fd, FUSE_DEV_IOC_CLONE, &src)`: makes `fd` (a fresh /dev/fuse open) another
/// channel of the FUSE connection behind `src`.
pub fn fuse_clone(fd: RawFd, src: RawFd) -> io::Result<()> {
    const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500; // _IOR(229, 0, uint32_t)
    let src32: u32 = src as u32;
    // SAFETY: the ioctl reads one u32 from the pointer, which points to a live local.
    check(unsafe { libc::ioctl(fd, FUSE_DEV_IOC_CLONE, &src32 as *const u32) })
}

/// mount(2).
pub fn mount(
    source: &str,
    target: &std::path::Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let cstr = |s: &[u8]| CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
    let (src, tgt, fs, dat) = (
        cstr(source.as_bytes())?,
        cstr(target.as_os_str().as_bytes())?,
        cstr(fstype.as_bytes())?,
        cstr(data.as_bytes())?,
    );
    // SAFETY: all four pointers are NUL-terminated strings that live for the call.
    check(unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fs.as_ptr(),
            flags,
            dat.as_ptr().cast(),
        )
    })
}

/// umount2(2).
pub fn umount(target: &std::path::Path, flags: i32) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let t = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `t` is a NUL-terminated string that lives for the call.
    check(unsafe { libc::umount2(t.as_ptr(), flags) })
}

/// A child process that unmounts `target` (lazily) as soon as this process is gone, even
/// after SIGKILL: it waits for end-of-file on a pipe whose only writer is us.
pub struct UnmountWatchdog {
    pid: i32,
    pipe_w: Option<std::os::fd::OwnedFd>,
}

impl UnmountWatchdog {
    /// Starts the watchdog for `target`.
    pub fn spawn(target: &std::path::Path) -> io::Result<Self> {
        use std::ffi::CString;
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        let t = CString::new(target.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two fds into the array.
        check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
        let (r, w) = (fds[0], fds[1]);
        // SAFETY: the child only makes async-signal-safe calls (close_range, read, umount2,
        // _exit) on memory prepared before the fork, so forking a threaded process is sound.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            // SAFETY: closing the two fds pipe2 just gave us.
            unsafe {
                libc::close(r);
                libc::close(w);
            }
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: see above; the child never returns into Rust code.
            unsafe {
                // Keep only the read end (as fd 0), so nothing else of ours stays open.
                libc::dup2(r, 0);
                libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32);
                let mut b = [0u8; 1];
                while libc::read(0, b.as_mut_ptr().cast(), 1) != 0 {
                    if *libc::__errno_location() != libc::EINTR {
                        break;
                    }
                }
                libc::umount2(t.as_ptr(), libc::MNT_DETACH);
                libc::_exit(0);
            }
        }
        // SAFETY: closing our copy of the read end; the write end becomes owned.
        unsafe { libc::close(r) };
        // SAFETY: `w` came from pipe2 and is owned by nobody else.
        let pipe_w = Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(w) });
        Ok(Self { pid, pipe_w })
    }
}

impl Drop for UnmountWatchdog {
    fn drop(&mut self) {
        // Closing the pipe wakes the watchdog (its unmount is then a harmless no-op if we
        // unmounted already); reap it.
        self.pipe_w.take();
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

/// One `len`-byte pread at `offset` into a fresh 4 KiB-aligned buffer (to probe what
/// O_DIRECT accepts); returns the raw result (count or -errno).
pub fn direct_read(fd: RawFd, len: usize, offset: u64) -> i32 {
    use stord_aio::IoBufMut;
    let mut buf = crate::buf::new_buf(len);
    // SAFETY: the buffer is ours, aligned, and `len` bytes long.
    unsafe { stord_aio::sys::blocking::pread(fd, buf.stable_mut_ptr(), len, offset) }
}

/// Whether reads of the file can be tried without blocking (the kernel's FMODE_NOWAIT):
/// a one-byte RWF_NOWAIT read is refused with EOPNOTSUPP only when they cannot. tmpfs,
/// for one, cannot. Any other answer (data, EAGAIN, EINVAL for O_DIRECT's alignment) means
/// they can.
pub fn reads_can_be_tried_nowait(fd: RawFd) -> bool {
    let mut byte = [0u8; 1];
    let iov = [libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    }];
    // SAFETY: the iovec names `byte`, writable and alive for the call.
    let r = unsafe { stord_aio::sys::blocking::preadv(fd, &iov, 0, libc::RWF_NOWAIT) };
    r != -libc::EOPNOTSUPP
}

/// One byte of an open file description's OFD lock: takes a shared (read) lock at
/// `offset` (`lock`), or drops it. Fails with EAGAIN/EACCES when another description
/// holds a conflicting lock.
pub fn ofd_lock_byte(fd: RawFd, offset: u64, lock: bool) -> io::Result<()> {
    // SAFETY: flock is plain data; all-zero is a valid value before we set its fields.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = if lock { libc::F_RDLCK } else { libc::F_UNLCK } as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = offset as i64;
    fl.l_len = 1;
    // SAFETY: fcntl(F_OFD_SETLK) reads the flock we pass, which outlives the call.
    check(unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) })
}

/// Whether another open file description holds a lock on the byte at `offset` that a
/// write lock would conflict with (any lock: QEMU's test).
pub fn ofd_byte_locked_elsewhere(fd: RawFd, offset: u64) -> io::Result<bool> {
    // SAFETY: as above.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = offset as i64;
    fl.l_len = 1;
    // SAFETY: fcntl(F_OFD_GETLK) fills the flock we pass, which outlives the call.
    check(unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) })?;
    Ok(fl.l_type != libc::F_UNLCK as i16)
}

/// Gives memory the allocator holds free back to the system (glibc keeps freed heap memory
/// for reuse: after a burst of connections that came and went, the daemon would otherwise
/// stay at its peak).
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

thread_local! {
    static TRIM_SCHEDULED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Calls [`release_free_memory`] on the current loop a second from now, once however many
/// times it is asked for meanwhile (a connection that ends asks; a burst costs one trim).
pub fn release_free_memory_soon() {
    if TRIM_SCHEDULED.with(|s| s.replace(true)) {
        return;
    }
    let scheduled = stord_aio::with_current_context(|ctx| {
        ctx.add_timer(stord_aio::sys::now_ns() + 1_000_000_000, || {
            TRIM_SCHEDULED.with(|s| s.set(false));
            release_free_memory();
        });
    });
    if scheduled.is_none() {
        TRIM_SCHEDULED.with(|s| s.set(false));
    }
}

/// Ends the process at once with `code`: no destructors and no atexit handlers (a
/// library's teardown could wait on, or race with, a thread stuck in storage that does
/// not answer). Standard output is flushed first.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: _exit ends the process; nothing runs after it.
    unsafe { libc::_exit(code) }
}

/// The host's page size (QEMU's qemu_real_host_page_size).
pub fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the running system; it takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// A block device's largest request in bytes (BLKSECTGET's sectors × 512, as QEMU's
/// hdev_get_max_hw_transfer reads it), if the device says.
pub fn block_max_transfer(fd: RawFd) -> Option<u64> {
    let mut sectors: libc::c_ushort = 0;
    // BLKSECTGET, _IO(0x12, 103): not in the libc crate.
    const BLKSECTGET: libc::c_ulong = 0x1267;
    // SAFETY: BLKSECTGET writes one unsigned short through the pointer, which is ours.
    let r = unsafe { libc::ioctl(fd, BLKSECTGET, &mut sectors as *mut libc::c_ushort) };
    (r == 0 && sectors > 0).then(|| u64::from(sectors) * 512)
}

/// Sets an integer socket option.
pub fn setsockopt_int(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: the option value is an int of ours, its size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Reads an integer socket option.
pub fn getsockopt_int(fd: RawFd, level: i32, name: i32) -> io::Result<i32> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `value`, an int of ours.
    let r = unsafe { libc::getsockopt(fd, level, name, (&mut value as *mut i32).cast(), &mut len) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(value)
    }
}

/// Puts a descriptor in non-blocking mode.
pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL and F_SETFL take and return plain flags; no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// Sends `data` with `fd` attached (SCM_RIGHTS).
    fn send_with_fd(sock: &UnixStream, data: &[u8], fd: RawFd) {
        let mut control = [0u64; 4];
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut _,
            iov_len: data.len(),
        };
        // SAFETY: msghdr points at live `iov`, `data` and `control`; the CMSG_* macros stay
        // within `control`, which has room for one descriptor.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
            libc::CMSG_DATA(c).cast::<libc::c_int>().write_unaligned(fd);
            assert_eq!(
                libc::sendmsg(sock.as_raw_fd(), &msg, 0),
                data.len() as isize
            );
        }
    }

    #[test]
    fn tmpfs_reads_cannot_be_tried_nowait_and_ext4s_can() {
        let probe = |dir: &str, direct: bool| {
            let path = format!("{dir}/stord-nowait-probe-{}-{direct}", std::process::id());
            std::fs::write(&path, vec![1u8; 8192]).unwrap();
            let mut oo = std::fs::OpenOptions::new();
            oo.read(true);
            if direct {
                std::os::unix::fs::OpenOptionsExt::custom_flags(&mut oo, libc::O_DIRECT);
            }
            let f = oo.open(&path).unwrap();
            let r = reads_can_be_tried_nowait(f.as_raw_fd());
            std::fs::remove_file(&path).unwrap();
            r
        };
        // /dev/shm is tmpfs on this kind of machine: no FMODE_NOWAIT, with or without
        // O_DIRECT. The build tree is on ext4, which has it (O_DIRECT's EINVAL for the
        // unaligned byte is not a refusal).
        assert!(!probe("/dev/shm", false));
        assert!(!probe("/dev/shm", true));
        let here = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target");
        assert!(probe(here, false));
        assert!(probe(here, true));
    }

    #[test]
    fn a_peek_leaves_the_message_and_can_copy_its_descriptor() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let (passed, mut other_end) = UnixStream::pair().unwrap();
        send_with_fd(&a, b"hello", passed.as_raw_fd());
        let mut buf = [0u8; 3];
        let (n, fd) = peek_message(b.as_raw_fd(), &mut buf, false).unwrap();
        assert_eq!((n, &buf, fd.is_none()), (3, b"hel", true));
        let (n, fd) = peek_message(b.as_raw_fd(), &mut buf, true).unwrap();
        assert_eq!(n, 3);
        // The copy reaches the same socket.
        let mut copy = UnixStream::from(fd.expect("a descriptor"));
        std::io::Write::write_all(&mut copy, b"x").unwrap();
        let mut got = [0u8; 1];
        other_end.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x");
        // The message is still there for the real reader.
        let mut all = [0u8; 5];
        b.read_exact(&mut all).unwrap();
        assert_eq!(&all, b"hello");
    }
}
