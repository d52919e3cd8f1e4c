//! NBD over TLS with clients nobody here wrote: libnbd (nbdinfo, nbdcopy) and qemu-img,
//! with certificates made by the openssl command, as a user would make them. The identity
//! format of `authz-simple` is checked against qemu-storage-daemon itself.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::rawnbd::{closed_silently, hello, read_option_reply, send_option};
use common::rawqmp::{monitor_args, RawQmp};
use common::*;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_LIST: u32 = 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

/// The subject of the client certificate, as QEMU (GnuTLS) writes it: certificate order.
const CLIENT_DN: &str = "C=GB,O=Example Org,CN=client.example.com";

/// A test PKI: `server/` (qsd's server file names), `client/` (a certificate the CA signed),
/// `other/` (the same CA, another name), `stranger/` (another CA), `nocert/` (only the CA).
struct Pki {
    root: PathBuf,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let root = dir.join("pki");
        for d in ["server", "client", "other", "stranger", "nocert"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let p = |s: &str| root.join(s).display().to_string();
        let ca = |name: &str, key: &str, cert: &str| {
            run_ok(
                "openssl",
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "30",
                    "-keyout",
                    key,
                    "-out",
                    cert,
                    "-subj",
                    name,
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            );
        };
        ca(
            "/CN=stord test CA",
            &p("ca-key.pem"),
            &p("server/ca-cert.pem"),
        );
        ca("/CN=another CA", &p("ca2-key.pem"), &p("ca2-cert.pem"));
        let sign = |subj: &str, key: &str, cert: &str, ext: &str, ca: &str, ca_key: &str| {
            let csr = format!("{cert}.csr");
            let extfile = format!("{cert}.ext");
            std::fs::write(&extfile, ext).unwrap();
            run_ok(
                "openssl",
                &[
                    "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", &csr, "-subj",
                    subj,
                ],
            );
            run_ok(
                "openssl",
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    ca,
                    "-CAkey",
                    ca_key,
                    "-CAcreateserial",
                    "-out",
                    cert,
                    "-days",
                    "30",
                    "-extfile",
                    &extfile,
                ],
            );
        };
        let (ca_cert, ca_key) = (p("server/ca-cert.pem"), p("ca-key.pem"));
        sign(
            "/O=stord/CN=localhost",
            &p("server/server-key.pem"),
            &p("server/server-cert.pem"),
            "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
            &ca_cert,
            &ca_key,
        );
        let client_ext = "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n";
        for (d, subj) in [
            ("client", "/C=GB/O=Example Org/CN=client.example.com"),
            ("other", "/C=GB/O=Example Org/CN=other.example.com"),
        ] {
            sign(
                subj,
                &p(&format!("{d}/client-key.pem")),
                &p(&format!("{d}/client-cert.pem")),
                client_ext,
                &ca_cert,
                &ca_key,
            );
        }
        sign(
            "/CN=client.example.com",
            &p("stranger/client-key.pem"),
            &p("stranger/client-cert.pem"),
            client_ext,
            &p("ca2-cert.pem"),
            &p("ca2-key.pem"),
        );
        // Clients check the server against the CA; the stranger trusts the real one too.
        for d in ["client", "other", "stranger", "nocert"] {
            std::fs::copy(
                root.join("server/ca-cert.pem"),
                root.join(d).join("ca-cert.pem"),
            )
            .unwrap();
        }
        Pki { root }
    }

    fn dir(&self, d: &str) -> String {
        self.root.join(d).display().to_string()
    }
}

/// A libnbd URI over TLS to export `disk` on `sock`, with client credentials from `certs`.
fn tls_uri(sock: &Path, certs: &str) -> String {
    format!(
        "nbds+unix:///disk?socket={}&tls-certificates={certs}",
        sock.display()
    )
}

/// qemu-img's image options for export `disk` on `sock` through TLS object `tls0`.
fn qemu_opts(sock: &Path) -> String {
    format!(
        "driver=nbd,server.type=unix,server.path={},export=disk,tls-creds=tls0,tls-hostname=localhost",
        sock.display()
    )
}

fn x509_client(dir: &str) -> String {
    format!("tls-creds-x509,id=tls0,endpoint=client,dir={dir}")
}

/// stord (or qsd) serving `image` as `disk` on `sock`, with `objects` and `server_extra`
/// (e.g. `,tls-creds=tls0`).
fn start_daemon(
    program: &str,
    dir: &Path,
    sock: &Path,
    objects: &[String],
    server_extra: &str,
    image: &Path,
) -> Child {
    let _ = std::fs::remove_file(sock);
    // Ready once the pid file is there: qsd (and stord) write it after the NBD server
    // and the exports exist. The socket's file appears earlier, before the export is added.
    let pidfile = dir.join("daemon.pid");
    let _ = std::fs::remove_file(&pidfile);
    let mut args: Vec<String> = vec!["--pidfile".into(), pidfile.display().to_string()];
    for o in objects {
        args.push("--object".into());
        args.push(o.clone());
    }
    args.extend([
        "--blockdev".into(),
        format!("driver=file,node-name=disk,filename={}", image.display()),
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}{server_extra}", sock.display()),
        "--export".into(),
        "type=nbd,id=exp0,node-name=disk,name=disk,writable=on".into(),
    ]);
    let mut child = Command::new(program)
        .args(&args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let start = Instant::now();
    while !pidfile.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("{program} exited early: {st}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{program} did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

fn stop(mut c: Child) {
    c.kill().unwrap();
    c.wait().unwrap();
}

/// Whether nbdinfo gets through to the export (its error text, if not).
fn nbdinfo(uri: &str) -> Result<String, String> {
    let out = run("nbdinfo", &["--size", uri]);
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn x509_reads_and_writes_with_real_clients_and_refuses_the_rest() {
    let dir = tmpdir("tls-x509");
    let pki = Pki::new(&dir);
    let image = dir.join("disk.raw");
    sparse_image(&image, 16 << 20);
    let sock = dir.join("nbd.sock");
    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=server,dir={}",
        pki.dir("server")
    );
    let mut stord = start_daemon(
        env!("CARGO_BIN_EXE_stord"),
        &dir,
        &sock,
        &[creds],
        ",tls-creds=tls0",
        &image,
    );

    // qemu-img writes 4 MiB of random data through TLS, then compares it through TLS.
    let src = dir.join("src.raw");
    run_ok(
        "sh",
        &[
            "-c",
            &format!("head -c 4M /dev/urandom > {}", src.display()),
        ],
    );
    let client = x509_client(&pki.dir("client"));
    let src_s = src.display().to_string();
    let target = qemu_opts(&sock);
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            &src_s,
            "--object",
            &client,
            "--target-image-opts",
            &target,
        ],
    );
    let out = run_ok(
        "qemu-img",
        &[
            "compare",
            "--object",
            &client,
            "--image-opts",
            &target,
            &format!("driver=raw,file.driver=file,file.filename={src_s}"),
        ],
    );
    assert!(
        out.contains("identical") || out.contains("Warning - Image size mismatch"),
        "{out}"
    );
    // libnbd reads it back: nbdcopy's first 4 MiB are what qemu-img wrote.
    let copy = dir.join("copy.raw");
    run_ok(
        "nbdcopy",
        &[
            &tls_uri(&sock, &pki.dir("client")),
            &copy.display().to_string(),
        ],
    );
    let copied = std::fs::read(&copy).unwrap();
    assert_eq!(&copied[..4 << 20], &std::fs::read(&src).unwrap()[..]);
    assert_eq!(
        nbdinfo(&tls_uri(&sock, &pki.dir("client"))).unwrap(),
        "16777216"
    );

    // A client without TLS: every option but STARTTLS is answered TLS_REQD, EXPORT_NAME
    // closes, and nbdinfo gets nowhere.
    let mut s = hello(&sock, 3);
    send_option(&mut s, OPT_LIST, &[]);
    assert_eq!(read_option_reply(&mut s).1, REP_ERR_TLS_REQD);
    // Header and name in one write: the server closes after the header, and a second
    // write could meet the closed socket.
    let mut export_name = b"IHAVEOPT".to_vec();
    export_name.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    export_name.extend_from_slice(&4u32.to_be_bytes());
    export_name.extend_from_slice(b"disk");
    s.write_all(&export_name).unwrap();
    assert!(closed_silently(&mut s));
    let plain = format!("nbd+unix:///disk?socket={}", sock.display());
    assert!(nbdinfo(&plain).is_err());
    // verify-peer=on (the default): no certificate, or one another CA signed, is refused.
    let no_cert = nbdinfo(&tls_uri(&sock, &pki.dir("nocert")));
    assert!(no_cert.is_err(), "{no_cert:?}");
    let stranger = nbdinfo(&tls_uri(&sock, &pki.dir("stranger")));
    assert!(stranger.is_err(), "{stranger:?}");
    // A client that sends garbage instead of a ClientHello loses only its connection.
    let mut s = hello(&sock, 3);
    send_option(&mut s, 5, &[]); // STARTTLS
    assert_eq!(read_option_reply(&mut s).1, 1); // ACK
    s.write_all(&[0x16, 3, 3, 0, 5, 1, 2, 3, 4, 5]).unwrap();
    assert!(closed_silently(&mut s));
    // Everyone else is still served.
    assert_eq!(
        nbdinfo(&tls_uri(&sock, &pki.dir("client"))).unwrap(),
        "16777216"
    );
    assert!(stord.try_wait().unwrap().is_none(), "stord died");
    stop(stord);
}

#[test]
fn verify_peer_off_serves_clients_without_certificates() {
    let dir = tmpdir("tls-noverify");
    let pki = Pki::new(&dir);
    let image = dir.join("disk.raw");
    sparse_image(&image, 1 << 20);
    let sock = dir.join("nbd.sock");
    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer=off",
        pki.dir("server")
    );
    let d = start_daemon(
        env!("CARGO_BIN_EXE_stord"),
        &dir,
        &sock,
        &[creds],
        ",tls-creds=tls0",
        &image,
    );
    assert_eq!(
        nbdinfo(&tls_uri(&sock, &pki.dir("nocert"))).unwrap(),
        "1048576"
    );
    // A client certificate is not required, but one is still accepted.
    assert_eq!(
        nbdinfo(&tls_uri(&sock, &pki.dir("client"))).unwrap(),
        "1048576"
    );
    stop(d);
}

#[test]
fn authz_simple_admits_the_same_identities_as_qsd() {
    let dir = tmpdir("tls-authz");
    let pki = Pki::new(&dir);
    let image = dir.join("disk.raw");
    sparse_image(&image, 1 << 20);
    // The identity written as qsd's manual writes it (commas doubled on the command line).
    let objects = [
        format!(
            "tls-creds-x509,id=tls0,endpoint=server,dir={}",
            pki.dir("server")
        ),
        format!(
            "authz-simple,id=auth0,identity={}",
            CLIENT_DN.replace(',', ",,")
        ),
    ];
    let mut seen = Vec::new();
    for program in [env!("CARGO_BIN_EXE_stord"), "qemu-storage-daemon"] {
        let sock = dir.join("nbd.sock");
        let d = start_daemon(
            program,
            &dir,
            &sock,
            &objects,
            ",tls-creds=tls0,tls-authz=auth0",
            &image,
        );
        let allowed = nbdinfo(&tls_uri(&sock, &pki.dir("client"))).is_ok();
        let other = nbdinfo(&tls_uri(&sock, &pki.dir("other"))).is_ok();
        stop(d);
        seen.push((program, allowed, other));
    }
    assert_eq!(seen[0].1, seen[1].1, "{seen:?}");
    assert_eq!(seen[0].2, seen[1].2, "{seen:?}");
    assert!(seen[0].1 && !seen[0].2, "{seen:?}");
}

#[test]
fn psk_with_nbdinfo_and_qemu_img() {
    let dir = tmpdir("tls-psk");
    let image = dir.join("disk.raw");
    sparse_image(&image, 2 << 20);
    let keys = dir.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let alice = "alice:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let bob = "bob:fedcba9876543210fedcba9876543210";
    std::fs::write(keys.join("keys.psk"), format!("{alice}\n{bob}\n")).unwrap();
    // Each client's own file holds only its key.
    let alice_dir = dir.join("alice");
    std::fs::create_dir_all(&alice_dir).unwrap();
    std::fs::write(alice_dir.join("keys.psk"), format!("{alice}\n")).unwrap();
    let wrong = dir.join("wrong.psk");
    std::fs::write(&wrong, "alice:00112233445566778899aabbccddeeff\n").unwrap();
    let sock = dir.join("nbd.sock");
    let objects = [
        format!(
            "tls-creds-psk,id=tls0,endpoint=server,dir={}",
            keys.display()
        ),
        "authz-simple,id=auth0,identity=alice".to_string(),
    ];
    let d = start_daemon(
        env!("CARGO_BIN_EXE_stord"),
        &dir,
        &sock,
        &objects,
        ",tls-creds=tls0,tls-authz=auth0",
        &image,
    );
    // libnbd takes the username from the URI.
    let uri = |user: &str, file: &Path| {
        format!(
            "nbds+unix://{user}@/disk?socket={}&tls-psk-file={}",
            sock.display(),
            file.display()
        )
    };
    assert_eq!(
        nbdinfo(&uri("alice", &alice_dir.join("keys.psk"))).unwrap(),
        "2097152"
    );
    assert!(nbdinfo(&uri("alice", &wrong)).is_err());
    // Bob's key is good but authz-simple admits only alice.
    assert!(nbdinfo(&uri("bob", &keys.join("keys.psk"))).is_err());
    // qemu-img writes and reads back through a PSK session.
    let client = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        alice_dir.display()
    );
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export=disk,tls-creds=tls0",
        sock.display()
    );
    run_ok(
        "qemu-io",
        &[
            "--object",
            &client,
            "--image-opts",
            &opts,
            "-c",
            "write -P 0x5a 64k 64k",
        ],
    );
    let out = run_ok(
        "qemu-io",
        &[
            "--object",
            &client,
            "--image-opts",
            &opts,
            "-c",
            "read -P 0x5a 64k 64k",
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    stop(d);
    let data = std::fs::read(&image).unwrap();
    assert!(data[64 << 10..128 << 10].iter().all(|&b| b == 0x5a));
}

#[test]
fn tls_over_qmp_with_an_encrypted_key() {
    let dir = tmpdir("tls-qmp");
    let pki = Pki::new(&dir);
    // The server key, encrypted with a passphrase given as a secret object.
    let key = pki.root.join("server/server-key.pem");
    let plain_key = pki.root.join("plain-key.pem");
    std::fs::rename(&key, &plain_key).unwrap();
    run_ok(
        "openssl",
        &[
            "pkey",
            "-in",
            &plain_key.display().to_string(),
            "-aes256",
            "-passout",
            "pass:sesame",
            "-out",
            &key.display().to_string(),
        ],
    );
    assert!(std::fs::read_to_string(&key).unwrap().contains("ENCRYPTED"));
    let image = dir.join("disk.raw");
    sparse_image(&image, 1 << 20);
    let qmp_sock = dir.join("qmp.sock");
    let mut args = monitor_args(&qmp_sock);
    args.extend([
        "--blockdev".to_string(),
        format!("driver=file,node-name=disk,filename={}", image.display()),
    ]);
    let _stord = Stord::start(&dir, &args);
    let mut q = RawQmp::connect(&qmp_sock);
    let server = pki.dir("server");
    // Without the passphrase the key cannot be read: a clear error, no object.
    let r = q.send(&format!(
        r#"{{"execute":"object-add","arguments":{{"qom-type":"tls-creds-x509","id":"tls0","endpoint":"server","dir":"{server}"}}}}"#
    ));
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("server-key.pem"),
        "{r}"
    );
    let r = q.send(
        r#"{"execute":"object-add","arguments":{"qom-type":"secret","id":"sec0","data":"sesame"}}"#,
    );
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    let r = q.send(&format!(
        r#"{{"execute":"object-add","arguments":{{"qom-type":"tls-creds-x509","id":"tls0","endpoint":"server","dir":"{server}","verify-peer":true,"passwordid":"sec0"}}}}"#
    ));
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    // Client credentials (the nbd block driver's) cannot serve, in QEMU's words.
    let r = q.send(&format!(
        r#"{{"execute":"object-add","arguments":{{"qom-type":"tls-creds-x509","id":"tls1","endpoint":"client","dir":"{server}"}}}}"#
    ));
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    let r = q.send(r#"{"execute":"nbd-server-start","arguments":{"addr":{"type":"unix","data":{"path":"/tmp/x.sock"}},"tls-creds":"tls1"}}"#);
    assert_eq!(
        r["error"]["desc"], "Expected TLS credentials for a server endpoint",
        "{r}"
    );
    let r = q.send(r#"{"execute":"object-del","arguments":{"id":"tls1"}}"#);
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    let r = q.send(r#"{"execute":"object-add","arguments":{"qom-type":"tls-creds-x509","id":"tls1","endpoint":"server","dir":"/nonexistent"}}"#);
    assert!(
        r["error"]["desc"].as_str().unwrap().contains("ca-cert.pem"),
        "{r}"
    );
    let r = q.send(r#"{"execute":"nbd-server-start","arguments":{"addr":{"type":"unix","data":{"path":"/tmp/x.sock"}},"tls-creds":"nope"}}"#);
    assert!(r["error"]["desc"].as_str().unwrap().contains("nope"), "{r}");

    let sock = dir.join("nbd.sock");
    let r = q.send(&format!(
        r#"{{"execute":"nbd-server-start","arguments":{{"addr":{{"type":"unix","data":{{"path":"{}"}}}},"tls-creds":"tls0"}}}}"#,
        sock.display()
    ));
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    let r = q.send(r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"exp0","node-name":"disk","name":"disk"}}"#);
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    assert_eq!(
        nbdinfo(&tls_uri(&sock, &pki.dir("client"))).unwrap(),
        "1048576"
    );
    let plain = format!("nbd+unix:///disk?socket={}", sock.display());
    assert!(nbdinfo(&plain).is_err());
    // The running server holds the credentials.
    let r = q.send(r#"{"execute":"object-del","arguments":{"id":"tls0"}}"#);
    assert!(
        r["error"]["desc"].as_str().unwrap().contains("in use"),
        "{r}"
    );
    let r = q.send(r#"{"execute":"nbd-server-stop"}"#);
    assert_eq!(r["return"], serde_json::json!({}), "{r}");
    for id in ["tls0", "sec0"] {
        let r = q.send(&format!(
            r#"{{"execute":"object-del","arguments":{{"id":"{id}"}}}}"#
        ));
        assert_eq!(r["return"], serde_json::json!({}), "{r}");
    }
}

/// Resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// 300 clients that start TLS (STARTTLS, then half a record) and stall take memory while
/// they are there; once the handshake limit has cut them off, that memory goes back to the
/// system instead of staying at the peak.
#[test]
fn memory_of_stalled_tls_handshakes_goes_back_after_they_are_cut() {
    use std::io::{Read, Write};
    let dir = tmpdir("tls-stalled");
    let pki = Pki::new(&dir);
    let sock = dir.join("nbd.sock");
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let objects = [format!(
        "tls-creds-x509,id=tls0,endpoint=server,dir={},verify-peer=off",
        pki.dir("server")
    )];
    let child = start_daemon(
        env!("CARGO_BIN_EXE_stord"),
        &dir,
        &sock,
        &objects,
        ",tls-creds=tls0,handshake-max-seconds=2",
        &img,
    );
    let pid = child.id();
    std::thread::sleep(Duration::from_millis(300));
    let start = rss_kib(pid);
    let mut stalled = Vec::new();
    for _ in 0..300 {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&1u32.to_be_bytes()).unwrap(); // fixed newstyle
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&5u32.to_be_bytes()); // NBD_OPT_STARTTLS
        opt.extend_from_slice(&0u32.to_be_bytes());
        s.write_all(&opt).unwrap();
        let mut reply = [0u8; 20];
        s.read_exact(&mut reply).unwrap();
        s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).unwrap();
        stalled.push(s);
    }
    let peak = rss_kib(pid);
    assert!(
        peak > start + 8 * 1024,
        "stalled handshakes took {} KiB",
        peak - start
    );
    // Cut at 2 s; memory is given back a second after connections stop ending.
    std::thread::sleep(Duration::from_secs(5));
    let after = rss_kib(pid);
    assert!(
        after < start + 4 * 1024,
        "RSS {start} KiB at start, {peak} KiB with 300 stalled handshakes, {after} KiB after they were cut"
    );
    drop(stalled);
    stop(child);
}

/// A port on 127.0.0.1 free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// qemu-nbd serving `image` as `disk` on `addr` (`-k SOCK` or `-b HOST -p PORT`) with
/// server credentials `object` (none: plain NBD), until killed.
fn qemu_nbd(addr: &[&str], object: Option<&str>, image: &Path) -> Child {
    let mut cmd = Command::new("qemu-nbd");
    // Persistent, and many clients at once (both daemons' nodes, a reconnect).
    cmd.args(["-f", "raw", "-x", "disk", "-t", "-e", "16"])
        .args(addr);
    if let Some(o) = object {
        cmd.args(["--object", o, "--tls-creds", "tls0"]);
    }
    let child = cmd
        .arg(image)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn qemu-nbd");
    let start = Instant::now();
    let listening = || match addr {
        ["-k", path] => Path::new(path).exists(),
        [.., "-p", port] => std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok(),
        _ => unreachable!(),
    };
    while !listening() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "qemu-nbd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// A daemon with only a QMP monitor, and its monitor.
fn qmp_daemon(program: &str, dir: &Path) -> (Child, RawQmp) {
    let qmp = dir.join(format!("qmp-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&qmp);
    // Its stderr (stord's at debug level) is kept for a failure to print.
    let log = std::fs::File::create(daemon_log(program, dir)).unwrap();
    let child = Command::new(program)
        .args(monitor_args(&qmp))
        .current_dir(dir)
        .env("STORD_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
    let start = Instant::now();
    while !qmp.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{program} did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let q = RawQmp::connect(&qmp);
    // blockdev-add of an nbd node connects and negotiates TLS before it answers: on a
    // loaded two-CPU runner that can take longer than the usual 10 s.
    q.r.get_ref()
        .set_read_timeout(Some(Duration::from_secs(40)))
        .unwrap();
    (child, q)
}

/// Where [`qmp_daemon`] keeps `program`'s stderr.
fn daemon_log(program: &str, dir: &Path) -> PathBuf {
    let name = Path::new(program).file_name().unwrap().to_string_lossy();
    dir.join(format!("{name}.stderr"))
}

/// The reply's error class and text, or "ok".
fn outcome(r: &serde_json::Value) -> String {
    match r.get("error") {
        Some(e) => format!(
            "{}: {}",
            e["class"].as_str().unwrap(),
            e["desc"].as_str().unwrap()
        ),
        None => {
            assert_eq!(r["return"], serde_json::json!({}), "{r}");
            "ok".into()
        }
    }
}

/// The `nbd` block driver as a TLS client of qemu-nbd, beside qsd's: the same QMP flow
/// (x509 with and without the host name checked, the wrong CA, server credentials, a
/// server without TLS, PSK with the right and a wrong key) gets the same answers from both
/// daemons; then stord's node carries data both ways through an NBD export of its own
/// and comes back after the server restarts.
#[test]
fn nbd_client_node_over_tls_answers_as_qsd_and_carries_data() {
    let dir = tmpdir("tls-nbd-client");
    let pki = Pki::new(&dir);
    // Credentials whose CA is not the server's.
    let wrong_ca = pki.root.join("wrong-ca");
    std::fs::create_dir_all(&wrong_ca).unwrap();
    std::fs::copy(pki.root.join("ca2-cert.pem"), wrong_ca.join("ca-cert.pem")).unwrap();
    // The client's certificate, but the wrong CA: only verify-peer=off gets through.
    let no_verify = pki.root.join("no-verify");
    std::fs::create_dir_all(&no_verify).unwrap();
    std::fs::copy(pki.root.join("ca2-cert.pem"), no_verify.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(pki.root.join("client").join(f), no_verify.join(f)).unwrap();
    }
    // A server certificate with a CA that did not sign it.
    let bad_server = pki.root.join("bad-server");
    std::fs::create_dir_all(&bad_server).unwrap();
    std::fs::copy(
        pki.root.join("ca2-cert.pem"),
        bad_server.join("ca-cert.pem"),
    )
    .unwrap();
    for f in ["server-cert.pem", "server-key.pem"] {
        std::fs::copy(pki.root.join("server").join(f), bad_server.join(f)).unwrap();
    }
    // A keys.psk with alice's key in `name`/.
    let psk_dir = |name: &str, key: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("keys.psk"), format!("alice:{key}\n")).unwrap();
        d
    };
    let keys = psk_dir("keys", "0123456789abcdef0123456789abcdef");
    let bad_keys = psk_dir("bad-keys", "00112233445566778899aabbccddeeff");

    let image = dir.join("disk.raw");
    sparse_image(&image, 32 << 20);
    let port = free_port().to_string();
    let x509_server = format!(
        "tls-creds-x509,id=tls0,endpoint=server,dir={}",
        pki.dir("server")
    );
    let mut tcp = qemu_nbd(
        &["-b", "127.0.0.1", "-p", &port],
        Some(&x509_server),
        &image,
    );
    let plain_port = free_port().to_string();
    let mut plain = qemu_nbd(&["-b", "127.0.0.1", "-p", &plain_port], None, &image);
    let psk_sock = dir.join("psk.sock");
    let psk_sock_s = psk_sock.display().to_string();
    let mut psk = qemu_nbd(
        &["-k", &psk_sock_s],
        Some(&format!(
            "tls-creds-psk,id=tls0,endpoint=server,dir={}",
            keys.display()
        )),
        &image,
    );

    let objects = [
        ("x509", "tls-creds-x509", "client", pki.dir("client")),
        (
            "wrongca",
            "tls-creds-x509",
            "client",
            wrong_ca.display().to_string(),
        ),
        ("srv", "tls-creds-x509", "server", pki.dir("server")),
        (
            "noverify",
            "tls-creds-x509",
            "client",
            no_verify.display().to_string(),
        ),
        (
            "insane-srv",
            "tls-creds-x509",
            "server",
            bad_server.display().to_string(),
        ),
        // Our own certificate does not chain to this CA: refused (QEMU's sanity check).
        (
            "insane",
            "tls-creds-x509",
            "client",
            no_verify.display().to_string(),
        ),
        ("psk", "tls-creds-psk", "client", keys.display().to_string()),
        (
            "badpsk",
            "tls-creds-psk",
            "client",
            bad_keys.display().to_string(),
        ),
    ];
    let inet = |p: &str| format!(r#""server":{{"type":"inet","host":"127.0.0.1","port":"{p}"}}"#);
    let unix = format!(r#""server":{{"type":"unix","path":"{psk_sock_s}"}}"#);
    let cases: Vec<(&str, String, &str)> = vec![
        // The certificate names localhost, not 127.0.0.1.
        ("n1", inet(&port), r#""tls-creds":"x509""#),
        (
            "n2",
            inet(&port),
            r#""tls-creds":"x509","tls-hostname":"localhost""#,
        ),
        (
            "n3",
            inet(&port),
            r#""tls-creds":"wrongca","tls-hostname":"localhost""#,
        ),
        ("n4", inet(&port), r#""tls-creds":"srv""#),
        ("n5", inet(&port), r#""tls-creds":"nope""#),
        (
            "n6",
            inet(&plain_port),
            r#""tls-creds":"x509","tls-hostname":"localhost""#,
        ),
        ("n7", unix.clone(), r#""tls-creds":"psk""#),
        ("n8", unix.clone(), r#""tls-creds":"badpsk""#),
        // The server's certificate is not checked at all.
        ("n10", inet(&port), r#""tls-creds":"noverify""#),
        // TLS required, none offered.
        ("n9", inet(&port), r#""export":"disk""#),
    ];
    let mut seen: Vec<Vec<String>> = Vec::new();
    for program in [env!("CARGO_BIN_EXE_stord"), "qemu-storage-daemon"] {
        let (mut child, mut q) = qmp_daemon(program, &dir);
        let mut objects_seen = Vec::new();
        for (id, ty, endpoint, d) in &objects {
            // PSK clients name themselves (QEMU's default is "qemu").
            let user = if *id == "noverify" {
                r#","verify-peer":false,"sanity-check":false"#
            } else if ty.ends_with("psk") {
                r#","username":"alice""#
            } else {
                ""
            };
            let r = q.send(&format!(
                r#"{{"execute":"object-add","arguments":{{"qom-type":"{ty}","id":"{id}","endpoint":"{endpoint}","dir":"{d}"{user}}}}}"#
            ));
            objects_seen.push(format!("{id}: {}", outcome(&r)));
        }
        let mut answers = std::mem::take(&mut objects_seen);
        for (node, server, extra) in &cases {
            let export = if extra.contains("export") {
                ""
            } else {
                r#","export":"disk""#
            };
            let r = q.send(&format!(
                r#"{{"execute":"blockdev-add","arguments":{{"driver":"nbd","node-name":"{node}",{server}{export},{extra}}}}}"#
            ));
            answers.push(format!("{node}: {}", outcome(&r)));
        }
        if program == env!("CARGO_BIN_EXE_stord") {
            // A failure there shows what stord said (the reconnects, say) beside it.
            let carried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                stord_carries_data(&mut q, &dir, &image, &mut tcp, &port, &x509_server)
            }));
            if let Err(e) = carried {
                let log = std::fs::read_to_string(daemon_log(program, &dir)).unwrap_or_default();
                eprintln!("stord's stderr:\n{log}");
                std::panic::resume_unwind(e);
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        seen.push(answers);
    }
    for p in [&mut plain, &mut psk, &mut tcp] {
        let _ = p.kill();
        let _ = p.wait();
    }
    let (stord, qsd) = (&seen[0], &seen[1]);
    eprintln!("stord: {stord:#?}\nqsd: {qsd:#?}");
    for (s, q) in stord.iter().zip(qsd) {
        let ok = |a: &str| a.ends_with(": ok");
        assert_eq!(ok(s), ok(q), "stord {s} / qsd {q}");
        // The words too, where they are QEMU's own (a TLS library's alert texts differ).
        if !q.contains("TLS handshake failed") && !q.contains("Cannot read from TLS channel") {
            assert_eq!(s, q);
        }
    }
    for n in [
        "x509", "wrongca", "srv", "psk", "badpsk", "noverify", "n2", "n7", "n10",
    ] {
        assert!(stord.iter().any(|a| a == &format!("{n}: ok")), "{stord:?}");
    }
    for id in ["insane", "insane-srv"] {
        let refused = format!("{id}: GenericError: Our own certificate");
        assert!(stord.iter().any(|a| a.starts_with(&refused)), "{stord:?}");
    }
}

/// Node n2 (x509 to qemu-nbd on `port`) exported by stord: qemu-io writes through it and
/// reads back; the server's file holds the data; a server restarted under a node with
/// `reconnect-delay` serves the next read over a new TLS session.
fn stord_carries_data(
    q: &mut RawQmp,
    dir: &Path,
    image: &Path,
    tcp: &mut Child,
    port: &str,
    x509_server: &str,
) {
    let sock = dir.join("export.sock");
    let _ = std::fs::remove_file(&sock);
    let r = q.send(&format!(
        r#"{{"execute":"blockdev-add","arguments":{{"driver":"nbd","node-name":"rc","server":{{"type":"inet","host":"127.0.0.1","port":"{port}"}},"export":"disk","tls-creds":"x509","tls-hostname":"localhost","reconnect-delay":20}}}}"#
    ));
    assert_eq!(outcome(&r), "ok");
    let r = q.send(&format!(
        r#"{{"execute":"nbd-server-start","arguments":{{"addr":{{"type":"unix","data":{{"path":"{}"}}}}}}}}"#,
        sock.display()
    ));
    assert_eq!(outcome(&r), "ok");
    for (id, node) in [("e2", "n2"), ("erc", "rc")] {
        let r = q.send(&format!(
            r#"{{"execute":"block-export-add","arguments":{{"type":"nbd","id":"{id}","node-name":"{node}","name":"{node}","writable":true}}}}"#
        ));
        assert_eq!(outcome(&r), "ok");
    }
    let uri = |name: &str| format!("nbd+unix:///{name}?socket={}", sock.display());
    // Many small requests in flight over one TLS session, verified.
    fio_write_and_verify(&["--ioengine=nbd", &format!("--uri={}", uri("n2"))], "4M");
    // One request of 32 MiB, sent while the server is stopped: the socket fills, and
    // the connection's sender writes the rest of the records once the server reads again.
    let pid = tcp.id().to_string();
    run_ok("kill", &["-STOP", &pid]);
    let writer = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            &uri("n2"),
            "-c",
            "write -P 0x3c 0 32M",
            "-c",
            "flush",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    run_ok("kill", &["-CONT", &pid]);
    let out = writer.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("error"),
        "{}: {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run_ok(
        "qemu-io",
        &["-f", "raw", &uri("n2"), "-c", "read -P 0x3c 0 32M"],
    );
    assert!(!out.contains("verification failed"), "{out}");
    let data = std::fs::read(image).unwrap();
    assert!(data[..32 << 20].iter().all(|&b| b == 0x3c));
    // The server goes and comes back on the same port: the node's reconnect negotiates
    // TLS again and the read waits for it.
    let _ = tcp.kill();
    let _ = tcp.wait();
    let args = ["-b", "127.0.0.1", "-p", port];
    let restart = {
        let (x509, image) = (x509_server.to_string(), image.to_path_buf());
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            qemu_nbd(&a, Some(&x509), &image)
        })
    };
    let out = run_ok(
        "qemu-io",
        &["-f", "raw", &uri("rc"), "-c", "read -P 0x3c 1M 64k"],
    );
    assert!(!out.contains("verification failed"), "{out}");
    *tcp = restart.join().unwrap();
}
