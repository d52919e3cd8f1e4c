//! TCP keep-alive as QEMU's InetSocketAddress asks for it: `keep-alive` (SO_KEEPALIVE) and,
//! since QEMU 10.1, `keep-alive-count`, `keep-alive-idle` and `keep-alive-interval`
//! (TCP_KEEPCNT, TCP_KEEPIDLE, TCP_KEEPINTVL; 0 leaves the system's setting). As QEMU's
//! inet_set_sockopts, the three apply only with `keep-alive=on`, on the socket that
//! connects and (since 10.1) on the listening socket, whose accepted connections inherit
//! them. Both NBD ends take them: the server's `addr` and the client node's `server`.

use std::io;
use std::os::fd::RawFd;

use crate::cli::keyval::{KeyVal, OptionError};

/// The keep-alive members of one inet address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeepAlive {
    pub on: bool,
    pub count: u32,
    pub idle: u32,
    pub interval: u32,
}

impl KeepAlive {
    /// `PREFIX.keep-alive`, `PREFIX.keep-alive-count`, `-idle`, `-interval` (uint32 each).
    pub fn from_options(kv: &mut KeyVal, prefix: &str) -> Result<Self, OptionError> {
        let on = kv.take_bool(&format!("{prefix}.keep-alive"), false)?;
        let mut num = |name: &str| -> Result<u32, OptionError> {
            let key = format!("{prefix}.keep-alive-{name}");
            Ok(kv
                .take_u64_in(&key, false, 0..=u64::from(u32::MAX))?
                .unwrap_or(0) as u32)
        };
        Ok(KeepAlive {
            on,
            count: num("count")?,
            idle: num("idle")?,
            interval: num("interval")?,
        })
    }

    /// Sets them on `fd` (QEMU's inet_set_sockopts, with its words on failure). The
    /// kernel takes at most 32767 for the idle time and interval and 127 for the count.
    pub fn apply(&self, fd: RawFd) -> Result<(), String> {
        if !self.on {
            return Ok(());
        }
        let set = |level, name, value: u32, what: &str| {
            crate::sys::setsockopt_int(fd, level, name, value as i32)
                .map_err(|e: io::Error| format!("{what}: {}", crate::sys::os_text(&e)))
        };
        set(
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            1,
            "Unable to set keep-alive option on socket",
        )?;
        let tcp = [
            (self.count, libc::TCP_KEEPCNT, "count"),
            (self.idle, libc::TCP_KEEPIDLE, "idle"),
            (self.interval, libc::TCP_KEEPINTVL, "interval"),
        ];
        for (value, name, what) in tcp {
            if value != 0 {
                let text = format!("Unable to set TCP keep-alive {what} option on socket");
                set(libc::IPPROTO_TCP, name, value, &text)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn get(fd: RawFd, level: i32, name: i32) -> i32 {
        crate::sys::getsockopt_int(fd, level, name).unwrap()
    }

    #[test]
    fn options_parse_and_reach_the_socket_only_with_keep_alive_on() {
        let mut kv = KeyVal::from_pairs(
            "t",
            vec![
                ("addr.keep-alive".into(), "on".into()),
                ("addr.keep-alive-count".into(), "5".into()),
                ("addr.keep-alive-idle".into(), "60".into()),
            ],
        );
        let ka = KeepAlive::from_options(&mut kv, "addr").unwrap();
        assert_eq!((ka.on, ka.count, ka.idle, ka.interval), (true, 5, 60, 0));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fd = l.as_raw_fd();
        let before = get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL);
        ka.apply(fd).unwrap();
        assert_eq!(get(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 5);
        assert_eq!(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 60);
        assert_eq!(get(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), before);
        let off = KeepAlive {
            count: 3,
            ..Default::default()
        };
        let l2 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        off.apply(l2.as_raw_fd()).unwrap();
        assert_eq!(get(l2.as_raw_fd(), libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        let mut bad = KeyVal::from_pairs(
            "t",
            vec![("addr.keep-alive-count".into(), "4294967296".into())],
        );
        assert!(KeepAlive::from_options(&mut bad, "addr").is_err());
    }
}
