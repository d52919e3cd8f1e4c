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
    let mut args: Vec<String> = Vec::new();
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
    while !sock.exists() {
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
    // Unsupported values name the option and what is supported.
    let r = q.send(&format!(
        r#"{{"execute":"object-add","arguments":{{"qom-type":"tls-creds-x509","id":"tls1","endpoint":"client","dir":"{server}"}}}}"#
    ));
    assert!(
        r["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("endpoint=client"),
        "{r}"
    );
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
