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
