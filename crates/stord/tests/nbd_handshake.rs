//! The NBD handshake's rules, driven with raw sockets: which mistakes get an option reply
//! (and which error) and which close the connection, per the NBD protocol (and qemu's
//! server where the protocol leaves a choice), and the handshake time limit.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::rawnbd::*;
use common::*;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_POLICY: u32 = (1 << 31) + 2;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;
const FIXED_NO_ZEROES: u32 = 3;

fn server(name: &str, extra: &str) -> Stord {
    let dir = tmpdir(name);
    let sock = dir.join("nbd.sock");
    Stord::start(
        &dir,
        &[
            "--blockdev".into(),
            "driver=null-co,node-name=disk,size=64M".into(),
            "--nbd-server".into(),
            format!("addr.type=unix,addr.path={}{extra}", sock.display()),
            "--export".into(),
            "type=nbd,id=exp0,node-name=disk,name=disk".into(),
        ],
    )
}

/// LIST works: the connection is still in the negotiation phase and usable.
fn assert_alive(s: &mut std::os::unix::net::UnixStream) {
    send_option(s, OPT_LIST, &[]);
    let (opt, kind, _) = read_option_reply(s);
    assert_eq!((opt, kind), (OPT_LIST, REP_SERVER));
    assert_eq!(read_option_reply(s).1, REP_ACK);
}

#[test]
fn export_name_errors_close_without_a_reply() {
    let s = server("hs-export-name", "");
    // Over the protocol's 4096-byte limit: closed before the name is even read.
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    send_option_header(&mut c, OPT_EXPORT_NAME, 5000);
    assert!(
        closed_silently(&mut c),
        "a 5000-byte EXPORT_NAME must close"
    );
    // Far over any limit (an option reply here would be read as the export's size).
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    send_option_header(&mut c, OPT_EXPORT_NAME, 100 << 20);
    assert!(closed_silently(&mut c));
    // Unknown, and not a valid string.
    for name in [&b"nosuch"[..], b"di\0sk", b"\xff\xfe"] {
        let mut c = hello(&s.sock, FIXED_NO_ZEROES);
        send_option(&mut c, OPT_EXPORT_NAME, name);
        assert!(closed_silently(&mut c), "{name:?}");
    }
    // The right name still works.
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    send_option(&mut c, OPT_EXPORT_NAME, b"disk");
    let mut info = [0u8; 10];
    c.read_exact(&mut info).unwrap();
    assert_eq!(u64::from_be_bytes(info[..8].try_into().unwrap()), 64 << 20);
}

#[test]
fn oversized_options_are_skipped_with_the_right_error_or_close() {
    let s = server("hs-oversized", "");
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    let junk = vec![7u8; 100 << 10];
    // An unknown option is unsupported whatever its size.
    send_option(&mut c, 99, &junk);
    assert_eq!(read_option_reply(&mut c).1, REP_ERR_UNSUP);
    // A known one that is too large to honour.
    send_option(&mut c, OPT_INFO, &junk);
    assert_eq!(
        read_option_reply(&mut c),
        (OPT_INFO, REP_ERR_TOO_BIG, b"option too long".to_vec())
    );
    assert_alive(&mut c);
    // Beyond what the server will read through: closed.
    send_option_header(&mut c, OPT_INFO, 64 << 20);
    assert!(closed_silently(&mut c));
}

#[test]
fn clients_without_fixed_newstyle_may_only_send_export_name() {
    let s = server("hs-nonfixed", "");
    let mut c = hello(&s.sock, 0);
    send_option(&mut c, OPT_LIST, &[]);
    assert!(
        closed_silently(&mut c),
        "LIST from a non-fixed client must close"
    );
    // EXPORT_NAME works, with the 124 zero bytes such a client expects.
    let mut c = hello(&s.sock, 0);
    send_option(&mut c, OPT_EXPORT_NAME, b"disk");
    let mut info = [0u8; 10 + 124];
    c.read_exact(&mut info).unwrap();
    assert!(info[10..].iter().all(|&b| b == 0));
}

#[test]
fn option_errors_keep_the_connection() {
    let s = server("hs-errors", "");
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    send_option(&mut c, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut c).1, REP_ACK);
    send_option(&mut c, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(
        read_option_reply(&mut c).1,
        REP_ERR_INVALID,
        "repeated STRUCTURED_REPLY"
    );
    send_option(&mut c, OPT_STARTTLS, b"x");
    assert_eq!(
        read_option_reply(&mut c).1,
        REP_ERR_INVALID,
        "STARTTLS with data"
    );
    send_option(&mut c, OPT_STARTTLS, &[]);
    assert_eq!(
        read_option_reply(&mut c).1,
        REP_ERR_POLICY,
        "STARTTLS, no TLS"
    );
    // Names must be strings without NUL.
    send_option(&mut c, OPT_GO, &go_data(b"di\0sk"));
    assert_eq!(read_option_reply(&mut c).1, REP_ERR_INVALID);
    // An unknown name is echoed cut short, with control characters replaced.
    let long = format!("\x1b[31m{}", "x".repeat(3000));
    send_option(&mut c, OPT_INFO, &go_data(long.as_bytes()));
    let (_, kind, msg) = read_option_reply(&mut c);
    assert_eq!(kind, REP_ERR_UNKNOWN);
    let msg = String::from_utf8(msg).unwrap();
    assert!(msg.len() < 200, "{msg}");
    assert!(!msg.contains('\x1b'), "{msg}");
    assert_alive(&mut c);
    send_option(&mut c, OPT_GO, &go_data(b"disk"));
    loop {
        let (_, kind, _) = read_option_reply(&mut c);
        if kind == REP_ACK {
            break;
        }
    }
}

#[test]
fn a_client_that_stalls_in_the_handshake_is_cut_off() {
    let s = server("hs-timeout", ",handshake-max-seconds=1");
    let t = Instant::now();
    let mut c = hello(&s.sock, FIXED_NO_ZEROES);
    // Half an option header, then nothing.
    c.write_all(b"IHAVE").unwrap();
    assert!(closed_silently(&mut c));
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "closed after {waited:?}"
    );
    // A client that negotiates in time is not affected, and stays after the limit.
    let mut ok = RawNbd::connect(&s.sock, "disk");
    std::thread::sleep(Duration::from_millis(1500));
    let (e, d) = ok.read(1, 0, 4096);
    assert_eq!((e, d.len()), (0, 4096));
}
