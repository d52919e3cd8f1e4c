//! What the benchmarks serve from: the 1 GiB image file under `results/tmp` (filled with
//! data), its qcow2 copies, and the fast device (a loop device with direct I/O over a file
//! in /dev/shm); and the paths a session of one daemon uses.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::peers::repo_root;

/// The size of every image, the null device's included.
pub(crate) const IMAGE_SIZE: u64 = 1 << 30;

/// `results/tmp`, where images, sockets and mountpoints go (made if missing).
pub(crate) fn bench_dir() -> PathBuf {
    let d = repo_root().join("results/tmp");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A 1 GiB image filled with data, so O_DIRECT reads really reach the disk.
pub(crate) fn prepare_image(path: &Path) {
    if std::fs::metadata(path)
        .map(|m| m.len() == IMAGE_SIZE)
        .unwrap_or(false)
    {
        return;
    }
    eprintln!("preparing {} (1 GiB of data)...", path.display());
    let st = Command::new("fio")
        .args([
            "--name=fill",
            "--ioengine=libaio",
            "--direct=1",
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            &format!("--size={IMAGE_SIZE}"),
            &format!("--filename={}", path.display()),
        ])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("fio");
    assert!(st.success());
}

/// The qcow2 image of a `qcow2-KIND` backend, beside the raw one (`full`: every cluster
/// allocated with the raw image's data; `empty`: nothing allocated).
pub fn qcow2_image(img: &Path, kind: &str) -> PathBuf {
    img.with_file_name(format!("nbd-bench-{kind}.qcow2"))
}

/// The qcow2 image of backend `qcow2-KIND` (see [`qcow2_image`]), made with qemu-img:
/// `full` converted from the raw image once, `empty` created afresh.
pub(crate) fn prepare_qcow2(img: &Path, kind: &str) {
    let q = qcow2_image(img, kind);
    let (q, raw) = (q.display().to_string(), img.display().to_string());
    let args: Vec<&str> = match kind {
        "full" if Path::new(&q).exists() => return,
        "full" => vec!["convert", "-O", "qcow2", &raw, &q],
        _ => vec!["create", "-q", "-f", "qcow2", &q, "1G"],
    };
    let st = Command::new("qemu-img")
        .args(&args)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img {args:?}");
}

/// The fast-device medium: a loop device with direct I/O over a file in /dev/shm, so a
/// 4k read costs tens of microseconds and the daemons' own overhead shows. Attached for
/// one benchmark run, detached on drop.
pub(crate) struct FastDev {
    pub dev: PathBuf,
}

impl FastDev {
    pub fn attach() -> FastDev {
        let file = PathBuf::from("/dev/shm/stord-bench-fastdev.img");
        prepare_image(&file);
        let out = Command::new("losetup")
            .args(["--direct-io=on", "--find", "--show"])
            .arg(&file)
            .output()
            .expect("losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        eprintln!("fast device: {} over {}", dev.display(), file.display());
        FastDev { dev }
    }
}

impl Drop for FastDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

/// Paths the sessions share.
pub struct Paths {
    pub img: PathBuf,
    pub sock: PathBuf,
    pub mnt: PathBuf,
}

/// The media sessions serve from: the 1 GiB image file under `results/tmp` (filled when a
/// `file-*` backend is asked for) and the fast device (attached when `dev` is, detached
/// when this is dropped).
pub struct Media {
    file: PathBuf,
    fastdev: Option<FastDev>,
}

impl Media {
    pub fn prepare(backends: &[&str]) -> Media {
        let file = bench_dir().join("nbd-bench.img");
        if backends.iter().any(|b| b.starts_with("file-")) {
            prepare_image(&file);
        }
        let fastdev = backends.contains(&"dev").then(FastDev::attach);
        Media { file, fastdev }
    }

    /// The paths of a session on `backend`, its socket and FUSE mountpoint named after
    /// `tag` under `results/tmp`.
    pub fn paths(&self, backend: &str, tag: &str) -> Paths {
        let dir = bench_dir();
        let img = match (backend, &self.fastdev) {
            ("dev", Some(f)) => f.dev.clone(),
            _ => self.file.clone(),
        };
        Paths {
            img,
            sock: dir.join(format!("{tag}.sock")),
            mnt: dir.join(format!("{tag}-fuse-mnt")),
        }
    }
}
