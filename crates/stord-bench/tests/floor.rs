//! The density benchmark's floor server (`stord-bench floor-server`), driven by clients
//! nobody here wrote: nbdinfo sees the export qsd's null device would show, and qemu-io's
//! and fio's reads come back as zeroes (a hole chunk each), so the floor's figures are of
//! the same requests the daemons serve.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

struct Floor {
    child: Child,
    dir: PathBuf,
    sock: PathBuf,
}

impl Floor {
    /// The floor started on a daemon's command line, as the density benchmark starts it.
    fn start(name: &str) -> Floor {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("floor-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("nbd.sock");
        let pidfile = dir.join("pid");
        let child = Command::new(env!("CARGO_BIN_EXE_stord-bench"))
            .args([
                "floor-server",
                "--object",
                "iothread,id=io0",
                "--blockdev",
                "driver=null-co,node-name=d0,size=1073741824,read-zeroes=on,read-only=on",
                "--nbd-server",
                &format!("addr.type=unix,addr.path={}", sock.display()),
                "--export",
                "type=nbd,id=e0,node-name=d0,name=d0,iothread=io0",
                "--pidfile",
                &pidfile.display().to_string(),
            ])
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !pidfile.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the floor did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Floor { child, dir, sock }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///d0?socket={}", self.sock.display())
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out: Output = Command::new(cmd).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd} {args:?}: {text}");
    text
}

#[test]
fn the_floor_serves_reads_of_a_null_device_to_real_clients() {
    let f = Floor::start("clients");
    let info: serde_json::Value =
        serde_json::from_str(&run_ok("nbdinfo", &["--json", &f.uri()])).unwrap();
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], 1u64 << 30, "{info}");
    assert_eq!(export["is_read_only"], true, "{info}");
    let out = run_ok(
        "qemu-io",
        &["-r", "-f", "raw", "-c", "read -P 0 4096 64k", &f.uri()],
    );
    assert!(out.contains("read 65536/65536"), "{out}");
    // The density benchmark's client: fio's nbd engine, 4k random reads at QD1.
    let out = Command::new("fio")
        .args([
            "--name=floor",
            "--ioengine=nbd",
            &format!("--uri={}", f.uri()),
            "--rw=randread",
            "--bs=4k",
            "--iodepth=1",
            "--io_size=4M",
            "--size=1G",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "fio: {out:?}");
    let out = String::from_utf8_lossy(&out.stdout);
    let json = &out[out.find('{').expect("fio's json")..];
    let fio: serde_json::Value = serde_json::from_str(json).unwrap();
    let job = &fio["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["read"]["total_ios"], 1024, "{job}");
}

/// A client that agrees no structured replies (the density benchmark's idle clients) gets
/// a read's zeroes in a simple reply, and a write refused.
#[test]
fn a_simple_reply_carries_the_zeroes_and_writes_are_refused() {
    use std::io::{Read, Write};
    let f = Floor::start("simple");
    let mut s = std::os::unix::net::UnixStream::connect(&f.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap();
    // NBD_OPT_GO for "d0", no information requests.
    let mut opt = b"IHAVEOPT".to_vec();
    opt.extend_from_slice(&7u32.to_be_bytes());
    opt.extend_from_slice(&8u32.to_be_bytes());
    opt.extend_from_slice(&2u32.to_be_bytes());
    opt.extend_from_slice(b"d0");
    opt.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&opt).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        s.read_exact(&mut vec![0u8; len]).unwrap();
        assert!(kind < 1 << 31, "NBD_OPT_GO refused: {kind:#x}");
        if kind == 1 {
            break;
        }
    }
    let request = |kind: u16, handle: u64| {
        let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&8192u64.to_be_bytes());
        r.extend_from_slice(&4096u32.to_be_bytes());
        r
    };
    s.write_all(&request(0, 7)).unwrap();
    let mut reply = vec![0xffu8; 16 + 4096];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(reply[0..4], 0x6744_6698u32.to_be_bytes());
    assert_eq!(reply[4..8], [0; 4], "error");
    assert_eq!(reply[8..16], 7u64.to_be_bytes());
    assert!(reply[16..].iter().all(|&b| b == 0));
    // A write is refused (its payload, not sent here, would not be read).
    s.write_all(&request(1, 8)).unwrap();
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        22,
        "EINVAL"
    );
    assert_eq!(h[8..16], 8u64.to_be_bytes());
}
