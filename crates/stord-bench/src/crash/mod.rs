//! `stord-bench crash`: crash consistency by replay. Each workload writes through a qcow2
//! node whose file sits under `blklogwrites`; the log is then replayed onto a copy of the
//! image as it was before the workload, to every flush and to torn points between them
//! ([`points`]), and each point is checked: `qemu-img check` finds no corruption (leaks
//! are allowed, as QEMU allows them), and every guest sector reads back a value the
//! [`model`] allows (what was written before the last durable flush, or a later write).
//! The daemon is stord or qsd: the same checker run against QEMU is the control.

pub mod log;
mod model;
mod nbd;
mod points;
mod workload;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use crate::peers::{stord_binary, which, Daemon};
use crate::qmp::Qmp;
use log::Log;
use points::{Point, Rng};
use workload::{Guest, Record, Source, Workload, WORKLOADS};

/// The run's options.
pub struct Options {
    pub daemons: Vec<String>,
    pub workloads: Vec<String>,
    /// Crash points per workload (about half clean, half torn), besides the whole log.
    pub points: usize,
    pub seed: u64,
    pub stord: Option<PathBuf>,
    /// Scratch directory (removed at the end).
    pub dir: PathBuf,
    /// The checker's self-test: every Nth non-flush entry left out of the replay, as if
    /// the daemon had acknowledged flushes it did not make durable (0: none).
    pub lose_every: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            daemons: vec!["stord".into()],
            workloads: WORKLOADS.iter().map(|w| w.name.to_string()).collect(),
            points: 40,
            seed: 1,
            stord: None,
            dir: std::env::temp_dir().join(format!("stord-crash-{}", std::process::id())),
            lose_every: 0,
        }
    }
}

/// One workload's result.
#[derive(Serialize, Default)]
pub struct Outcome {
    pub daemon: String,
    pub workload: String,
    pub requests: u32,
    pub client_flushes: usize,
    pub log_entries: usize,
    pub log_flushes: usize,
    pub points: usize,
    pub torn_points: usize,
    /// Points `qemu-img check` found clean, and those with leaked clusters only.
    pub clean: usize,
    pub leaks_only: usize,
    /// Points whose only errors are OFLAG_COPIED flags of clusters an unfinished internal
    /// snapshot counted twice, as QEMU leaves them; repaired to leaks by `check -r all`
    /// (and the guest's data then checked).
    pub copied_flags: usize,
    /// Points with corruption (or an image qemu-img could not read).
    pub corrupt: usize,
    /// Points where a sector read back what the model does not allow.
    pub wrong_data: usize,
    /// Points where an internal snapshot was durable and its contents were checked.
    pub snapshot_points: usize,
    /// The whole log replayed gives the daemon's image byte for byte.
    pub replay_matches_image: bool,
    pub failures: Vec<String>,
    pub seconds: f64,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.corrupt == 0 && self.wrong_data == 0 && self.replay_matches_image
    }
}

/// Runs every workload on every daemon.
pub fn run(o: &Options) -> Vec<Outcome> {
    let mut out = Vec::new();
    for d in &o.daemons {
        for name in &o.workloads {
            let w = WORKLOADS
                .iter()
                .find(|w| w.name == name)
                .unwrap_or_else(|| panic!("unknown workload {name}"));
            let dir = o.dir.join(format!("{d}-{name}"));
            std::fs::create_dir_all(&dir).expect("create the scratch directory");
            let r = run_one(o, d, w, &dir);
            println!(
                "{d:6} {name:18} {} points ({} torn): {} clean, {} leaks only, {} copied flags, {} corrupt, {} wrong data{}",
                r.points,
                r.torn_points,
                r.clean,
                r.leaks_only,
                r.copied_flags,
                r.corrupt,
                r.wrong_data,
                if r.replay_matches_image { "" } else { "; the replayed log differs from the image" }
            );
            for f in &r.failures {
                println!("    {f}");
            }
            out.push(r);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let _ = std::fs::remove_dir_all(&o.dir);
    out
}

/// The scratch files of one workload.
struct Files {
    base: PathBuf,
    img: PathBuf,
    log: PathBuf,
    /// The source image of the jobs' workloads.
    src: PathBuf,
    nbd: PathBuf,
    qmp: PathBuf,
}

fn run_one(o: &Options, daemon: &str, w: &Workload, dir: &Path) -> Outcome {
    let start = Instant::now();
    let f = Files {
        base: dir.join("base.qcow2"),
        img: dir.join("img.qcow2"),
        log: dir.join("log"),
        src: dir.join("src.qcow2"),
        nbd: dir.join("nbd.sock"),
        qmp: dir.join("qmp.sock"),
    };
    qemu_img_create(&f.base, w);
    std::fs::copy(&f.base, &f.img).expect("copy the image");
    std::fs::write(&f.log, b"").expect("create the log");
    if w.source != Source::Logged {
        qemu_img_create(&f.src, w);
    }
    let guest = drive(o, daemon, w, &f);
    let mut r = check(o, &guest, &f);
    r.daemon = daemon.into();
    r.workload = w.name.into();
    r.requests = guest.model.next_op;
    r.client_flushes = guest.flushes.len();
    r.seconds = start.elapsed().as_secs_f64();
    r
}

fn qemu_img_create(path: &Path, w: &Workload) {
    let mut c = Command::new("qemu-img");
    c.args(["create", "-q", "-f", "qcow2"]);
    if !w.create.is_empty() {
        c.args(["-o", w.create]);
    }
    let st = c
        .arg(path)
        .arg(w.size.to_string())
        .status()
        .expect("run qemu-img");
    assert!(st.success(), "qemu-img create failed");
}

/// The daemon's command line: the image under blklogwrites under qcow2 (node `disk`),
/// exported, or for a job's workload the source image (node `src`) exported.
fn daemon_args(f: &Files, w: &Workload) -> Vec<String> {
    let p = |p: &Path| p.display().to_string();
    let mut nodes = vec![
        format!(
            "driver=file,node-name=img,filename={},discard=unmap",
            p(&f.img)
        ),
        format!("driver=file,node-name=logf,filename={}", p(&f.log)),
        "driver=blklogwrites,node-name=blw,file=img,log=logf,discard=unmap".into(),
        "driver=qcow2,node-name=disk,file=blw,discard=unmap".into(),
    ];
    let src = format!("driver=file,node-name=srcf,filename={}", p(&f.src));
    let exported = match w.source {
        Source::Logged => "disk",
        Source::Apart => {
            nodes.extend([src, "driver=qcow2,node-name=src,file=srcf".into()]);
            "src"
        }
        Source::Above => {
            nodes.extend([
                src,
                "driver=qcow2,node-name=src,file=srcf,backing=disk".into(),
            ]);
            "src"
        }
    };
    let mut args: Vec<String> = nodes
        .into_iter()
        .flat_map(|b| ["--blockdev".to_string(), b])
        .collect();
    args.extend([
        "--nbd-server".into(),
        format!("addr.type=unix,addr.path={}", p(&f.nbd)),
        "--export".into(),
        format!("type=nbd,id=e0,node-name={exported},name=disk,writable=on"),
        "--chardev".into(),
        format!("socket,id=qmp0,path={},server=on,wait=off", p(&f.qmp)),
        "--monitor".into(),
        "chardev=qmp0".into(),
    ]);
    args
}

/// Starts the daemon, runs the workload's guest, and has the daemon quit (so what it
/// writes as it closes the image is logged too).
fn drive(o: &Options, daemon: &str, w: &Workload, f: &Files) -> Record {
    let bin = match daemon {
        "stord" => o.stord.clone().unwrap_or_else(stord_binary),
        "qsd" => which("qemu-storage-daemon"),
        other => panic!("unknown daemon {other} (stord or qsd)"),
    };
    let mut d = Daemon::start(daemon, &bin, &daemon_args(f, w), &f.nbd);
    let nbd = nbd::Nbd::connect(&f.nbd, "disk").expect("connect over NBD");
    let qmp = Qmp::connect(&f.qmp).expect("connect to QMP");
    let mut g = Guest::new(nbd, qmp, &f.log, o.seed);
    (w.run)(&mut g).unwrap_or_else(|e| panic!("{daemon} {}: {e}", w.name));
    let wrong = g.read_back().expect("read the disk back");
    assert!(
        wrong.is_empty(),
        "{daemon} {}: the live disk reads {wrong:?}",
        w.name
    );
    let (rec, mut qmp) = g.quit();
    let _ = qmp.execute("quit", json!({}));
    let st = d.child.wait().expect("wait for the daemon");
    assert!(st.success(), "{daemon} exited with {st}");
    rec
}

/// Replays the log to each point and checks it.
fn check(o: &Options, g: &Record, f: &Files) -> Outcome {
    let log = Log::open(&f.log).expect("read the log");
    let mut rng = Rng::new(o.seed ^ 0x5eed);
    let points = points::choose(&log, o.points, &mut rng);
    let dir = f.base.parent().unwrap();
    let prefix_img = dir.join("prefix.qcow2");
    let point_img = dir.join("point.qcow2");
    std::fs::copy(&f.base, &prefix_img).expect("copy the base image");
    let prefix = std::fs::OpenOptions::new()
        .write(true)
        .open(&prefix_img)
        .unwrap();
    let mut r = Outcome {
        log_entries: log.entries.len(),
        log_flushes: log.flushes().len(),
        points: points.len(),
        torn_points: points.iter().filter(|p| p.torn.is_some()).count(),
        ..Outcome::default()
    };
    let mut applied = 0;
    for p in &points {
        while applied < p.prefix {
            let lost = o.lose_every > 0 && applied % o.lose_every == o.lose_every - 1;
            if !lost || log.entries[applied].is_flush() {
                log.replay(applied, &prefix, &|_| true).expect("replay");
            }
            applied += 1;
        }
        std::fs::copy(&prefix_img, &point_img).expect("copy the replayed image");
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open(&point_img)
            .unwrap();
        points::replay_window(&log, p, &dev).expect("replay");
        drop(dev);
        check_point(g, &log, p, &point_img, dir, &mut r);
    }
    r.replay_matches_image = std::fs::read(&prefix_img).ok() == std::fs::read(&f.img).ok();
    r
}

/// Everything checked at one point.
fn check_point(g: &Record, log: &Log, p: &Point, img: &Path, dir: &Path, r: &mut Outcome) {
    let what = format!(
        "point at entry {}{}",
        p.prefix,
        p.torn.map_or(String::new(), |s| format!(
            " torn to {} ({s:#x})",
            p.window_end
        ))
    );
    let fail = |r: &mut Outcome, m: String| {
        if r.failures.len() < 8 {
            r.failures.push(format!("{what}: {m}"));
        }
    };
    match verdict(img) {
        Verdict::Clean => r.clean += 1,
        Verdict::Leaks => r.leaks_only += 1,
        Verdict::CopiedFlags => r.copied_flags += 1,
        Verdict::Corrupt(e) => {
            r.corrupt += 1;
            return fail(r, e);
        }
    }
    let (durable, upto) = match g.frozen {
        Some(f) if p.prefix == log.entries.len() => (f, f),
        Some(f) => (0, f),
        None => (durable_op(g, log, p.prefix), u32::MAX),
    };
    let mut bad = match read_guest(img, dir, None) {
        Ok(raw) => g.model.check(&raw, durable, upto).1,
        Err(e) => vec![e],
    };
    if let Some(s) = &g.snapshot {
        let (durable_at, deleted_at) = (s.durable_at as usize, s.deleted_at as usize);
        if durable_prefix(log, durable_at) <= p.prefix && p.window_end.max(p.prefix) <= deleted_at {
            r.snapshot_points += 1;
            match read_guest(img, dir, Some(&s.name)) {
                Ok(raw) => bad.extend(
                    g.model
                        .check(&raw, s.frozen, s.frozen)
                        .1
                        .into_iter()
                        .map(|m| format!("snapshot {}: {m}", s.name)),
                ),
                Err(e) => bad.push(format!("snapshot {}: {e}", s.name)),
            }
        }
    }
    if let Some(b) = g.bitmap.as_ref().filter(|_| p.prefix == log.entries.len()) {
        if !image_has_bitmap(img, b) {
            bad.push(format!("the closed image has no bitmap {b}"));
        }
    }
    if !bad.is_empty() {
        r.wrong_data += 1;
        fail(r, bad.join("; "));
    }
}

/// The entries that must be replayed for the first `entries` to be durable: up to and
/// with the last flush entry among them.
fn durable_prefix(log: &Log, entries: usize) -> usize {
    log.flushes()
        .into_iter()
        .rfind(|&i| i < entries)
        .map_or(0, |i| i + 1)
}

/// The requests durable when the log's first `prefix` entries are: those before the
/// last client flush whose flush entry lies within them.
fn durable_op(g: &Record, log: &Log, prefix: usize) -> u32 {
    g.flushes
        .iter()
        .filter(|c| durable_prefix(log, c.entries as usize) <= prefix)
        .filter(|c| durable_prefix(log, c.entries as usize) > 0)
        .map(|c| c.durable)
        .max()
        .unwrap_or(0)
}

/// What `qemu-img check` made of a crash point.
enum Verdict {
    Clean,
    Leaks,
    /// Only clusters whose refcount and OFLAG_COPIED flag disagree, which QEMU's own
    /// internal snapshot leaves between its refcount update and its L2 update (qsd shows
    /// the same points): repaired by `qemu-img check -r all` to no worse than leaks.
    CopiedFlags,
    Corrupt(String),
}

/// `qemu-img check [-r all]`: its exit code, its ERROR lines and its summary line.
fn qemu_img_check(img: &Path, repair: bool) -> (Option<i32>, Vec<String>, String) {
    let mut c = Command::new("qemu-img");
    c.args(["check", "-f", "qcow2"]);
    if repair {
        c.args(["-r", "all"]);
    }
    let out = c.arg(img).output().expect("run qemu-img check");
    let errors = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with("ERROR"))
        .map(str::to_string)
        .collect();
    let summary = String::from_utf8_lossy(&out.stdout);
    let first = summary.lines().next().unwrap_or("").to_string();
    (out.status.code(), errors, first)
}

fn verdict(img: &Path) -> Verdict {
    let (code, errors, summary) = qemu_img_check(img, false);
    let describe = |code: Option<i32>, errors: &[String], summary: &str| {
        let first: Vec<&str> = errors.iter().take(3).map(String::as_str).collect();
        format!(
            "qemu-img check exited {code:?}: {} ({summary})",
            first.join(" / ")
        )
    };
    match code {
        Some(0) => Verdict::Clean,
        Some(3) => Verdict::Leaks,
        Some(2)
            if !errors.is_empty() && errors.iter().all(|e| e.starts_with("ERROR OFLAG_COPIED")) =>
        {
            qemu_img_check(img, true);
            match qemu_img_check(img, false) {
                (Some(0 | 3), _, _) => Verdict::CopiedFlags,
                (c, e, s) => Verdict::Corrupt(format!("after repair: {}", describe(c, &e, &s))),
            }
        }
        c => Verdict::Corrupt(describe(c, &errors, &summary)),
    }
}

/// The guest's view of the image (or of one of its internal snapshots), raw.
fn read_guest(img: &Path, dir: &Path, snapshot: Option<&str>) -> Result<Vec<u8>, String> {
    let raw = dir.join("guest.raw");
    let mut c = Command::new("qemu-img");
    c.args(["convert", "-f", "qcow2", "-O", "raw"]);
    if let Some(s) = snapshot {
        c.arg("-l").arg(format!("snapshot.name={s}"));
    }
    let out = c.arg(img).arg(&raw).output().expect("run qemu-img convert");
    if !out.status.success() {
        return Err(format!(
            "qemu-img convert: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let data = std::fs::read(&raw).map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&raw);
    data
}

fn image_has_bitmap(img: &Path, name: &str) -> bool {
    let out = Command::new("qemu-img")
        .args(["info", "--output=json", "-f", "qcow2"])
        .arg(img)
        .output()
        .expect("run qemu-img info");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["format-specific"]["data"]["bitmaps"]
        .as_array()
        .is_some_and(|bs| bs.iter().any(|b| b["name"] == name))
}

/// A markdown table of the outcomes.
pub fn markdown(rs: &[Outcome]) -> String {
    let mut s = String::from(
        "| daemon | workload | requests | log entries | flushes | points (torn) | clean | leaks only | copied flags | corrupt | wrong data | replay = image |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rs {
        s += &format!(
            "| {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} |\n",
            r.daemon,
            r.workload,
            r.requests,
            r.log_entries,
            r.log_flushes,
            r.points,
            r.torn_points,
            r.clean,
            r.leaks_only,
            r.copied_flags,
            r.corrupt,
            r.wrong_data,
            if r.replay_matches_image { "yes" } else { "no" }
        );
    }
    s
}
