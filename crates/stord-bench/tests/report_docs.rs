//! The report's document generator (scripts/bench_report.py) on a fixture run: it must
//! write the page with every section, one PNG per plot, and replace only the README's
//! headline block. The figures in the fixture are made up; what is checked is that the
//! numbers in the page are the ones computed from it.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn is_png(p: &Path) -> bool {
    std::fs::read(p)
        .map(|b| b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 5_000)
        .unwrap_or(false)
}

/// The fixture's row of `daemon` for the case the checks use: NBD, null, 4k randread QD16.
fn is_case(r: &serde_json::Value, daemon: &str) -> bool {
    r["export"] == "nbd"
        && r["backend"] == "null"
        && r["workload"] == "randread"
        && r["bs"] == "4k"
        && r["iodepth"] == 16
        && r["daemon"] == daemon
}

#[test]
fn generator_writes_page_plots_and_readme_headline() {
    let tmp = std::env::temp_dir().join(format!("stord-report-docs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let readme = tmp.join("README.md");
    std::fs::write(
        &readme,
        "# title\n\nbefore\n<!-- bench:headline -->\nold headline\n<!-- /bench:headline -->\nafter\n",
    )
    .unwrap();
    let fixture = repo().join("crates/stord-bench/tests/fixtures/report-sample.json");
    let out = Command::new("/usr/bin/python3")
        .arg(repo().join("scripts/bench_report.py"))
        .arg(&fixture)
        .arg("--docs")
        .arg(tmp.join("docs"))
        .arg("--readme")
        .arg(&readme)
        .output()
        .expect("run /usr/bin/python3 (scripts/install-deps.sh installs python3-matplotlib)");
    assert!(
        out.status.success(),
        "bench_report.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let page = std::fs::read_to_string(tmp.join("docs/benchmarks.md")).unwrap();
    for section in [
        "NBD",
        "FUSE",
        "vhost-user-blk",
        "offered load",
        "Poll window",
        "harvest",
        "Wake-up",
        "Idle",
    ] {
        assert!(
            page.to_lowercase().contains(&section.to_lowercase()),
            "page lacks a {section} section"
        );
    }

    // One ratio recomputed here: NBD, null, 4k randread QD16, stord-classic over qsd.
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    let row = |daemon: &str| -> &serde_json::Value {
        data["matrix"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| is_case(r, daemon))
            .unwrap()
    };
    let iops = |daemon: &str| row(daemon)["iops"].as_f64().unwrap();
    let ratio = format!("{:.2}", iops("stord-classic") / iops("qsd"));
    assert!(page.contains(&ratio), "page lacks the ratio {ratio}");

    // Its interval over the repetitions (stord's slowest run against qsd's fastest, and the
    // reverse) and the verdict that follows from it.
    let runs = |daemon: &str| -> (f64, f64) {
        let r = row(daemon);
        let v: Vec<f64> = r["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["iops"].as_f64().unwrap())
            .collect();
        (
            v.iter().cloned().fold(f64::MAX, f64::min),
            v.iter().cloned().fold(f64::MIN, f64::max),
        )
    };
    let (s, q) = (runs("stord-classic"), runs("qsd"));
    let (lo, hi) = (s.0 / q.1, s.1 / q.0);
    let interval = format!("[{lo:.2}–{hi:.2}]");
    assert!(
        page.contains(&interval),
        "page lacks the interval {interval}"
    );
    let verdict = if lo > 1.0 {
        "ahead"
    } else if hi < 1.0 {
        "behind"
    } else {
        "within noise"
    };
    let line = page
        .lines()
        .find(|l| l.contains(&interval))
        .unwrap()
        .to_string();
    assert!(
        line.contains(verdict),
        "{interval} should read {verdict}: {line}"
    );

    let plots = tmp.join("docs/plots");
    for name in [
        "iops-nbd.png",
        "cpu-nbd.png",
        "iops-fuse.png",
        "iops-vhost-user-blk.png",
        "curves.png",
        "poll-window.png",
        "harvest.png",
        "wakeup.png",
    ] {
        assert!(is_png(&plots.join(name)), "{name} missing or not a PNG");
        assert!(
            page.contains(&format!("plots/{name}")),
            "page does not show {name}"
        );
    }

    let r = std::fs::read_to_string(&readme).unwrap();
    assert!(r.starts_with("# title\n\nbefore\n<!-- bench:headline -->\n"));
    assert!(r.ends_with("<!-- /bench:headline -->\nafter\n"));
    assert!(!r.contains("old headline"), "headline block not replaced");
    assert!(r.contains("docs/benchmarks.md"));

    // A full run compares its verdicts with the previous full run's: here an earlier copy
    // in which stord-classic lost NBD null 4k randread QD16 outright.
    let mut full = data.clone();
    full["params"]["runtime_s"] = 5.0.into();
    full["params"]["reps"] = 3.into();
    full["unix_time"] = 3000.into();
    let mut old = full.clone();
    old["unix_time"] = 2000.into();
    for r in old["matrix"].as_array_mut().unwrap() {
        if is_case(r, "stord-classic") {
            for run in r["runs"].as_array_mut().unwrap() {
                run["iops"] = 1.0.into();
            }
        }
    }
    let history = tmp.join("history");
    std::fs::create_dir_all(&history).unwrap();
    std::fs::write(history.join("2000.json"), old.to_string()).unwrap();
    let full_json = tmp.join("full.json");
    std::fs::write(&full_json, full.to_string()).unwrap();
    let out = Command::new("/usr/bin/python3")
        .arg(repo().join("scripts/bench_report.py"))
        .arg(&full_json)
        .arg("--docs")
        .arg(tmp.join("docs-full"))
        .arg("--readme")
        .arg(&readme)
        .arg("--history")
        .arg(&history)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(tmp.join("docs-full/benchmarks.md")).unwrap();
    let section = &page[page
        .find("## Against the previous full run")
        .expect("no comparison with the previous run")..];
    assert!(section.contains(" agree."), "{section}");
    let changed = section
        .lines()
        .find(|l| {
            l.contains("stord-classic") && l.contains("randread QD16") && l.contains("| behind |")
        })
        .unwrap_or_else(|| panic!("the changed verdict is not listed:\n{section}"));
    assert!(changed.contains("NBD"), "{changed}");

    // A quick run is labelled as such and leaves the README's headline alone.
    let mut quick = data.clone();
    quick["params"]["quick"] = true.into();
    let quick_json = tmp.join("quick.json");
    std::fs::write(&quick_json, quick.to_string()).unwrap();
    std::fs::write(
        &readme,
        "<!-- bench:headline -->\nkept\n<!-- /bench:headline -->\n",
    )
    .unwrap();
    let out = Command::new("/usr/bin/python3")
        .arg(repo().join("scripts/bench_report.py"))
        .arg(&quick_json)
        .arg("--docs")
        .arg(tmp.join("docs-quick"))
        .arg("--readme")
        .arg(&readme)
        .output()
        .unwrap();
    assert!(out.status.success());
    let page = std::fs::read_to_string(tmp.join("docs-quick/benchmarks.md")).unwrap();
    assert!(page.contains("quick run"), "a quick run is not labelled");
    assert!(std::fs::read_to_string(&readme).unwrap().contains("kept"));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A `stord-bench density` run with made-up figures: stord, qsd and qsd-poll0 on 8
/// exports, each row's runs as (CPU ms/s, p99 µs).
fn density_run(rows: &[(&str, &[(f64, f64)])]) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|(daemon, runs)| {
            let runs: Vec<serde_json::Value> = runs
                .iter()
                .map(|&(cpu, p99)| {
                    serde_json::json!({
                        "cpu_ms_per_s": cpu, "cpu_us_per_io": cpu / 3.0, "iops": 3000.0,
                        "p50_us": 40.0, "p99_us": p99, "p999_us": p99 * 2.0,
                        "worst_p99_us": p99 * 1.5, "flat_iops": null,
                        "rss_kib_per_export": 1000.0, "short_clients": 0
                    })
                })
                .collect();
            serde_json::json!({
                "transport": "nbd", "backend": "null", "variant": "light", "shape": 8,
                "daemon": daemon, "rate_per_client": 375.0, "runs": runs, "idle_ms": 0.0
            })
        })
        .collect();
    serde_json::json!({
        "benchmark": "density", "runtime_s": 60, "ramp_s": 3, "reps": 2, "load": 0.5,
        "total_iops": 3000.0, "idle_s": 60, "kernel": "test", "unix_time": 1000,
        "result": { "maxima": [["nbd", "null", "stord", 6000.0]], "rows": rows }
    })
}

/// The page the generator writes with `run` as the only density run (in `tmp`, emptied
/// first).
fn density_page(tmp: &Path, run: &serde_json::Value) -> String {
    let _ = std::fs::remove_dir_all(tmp);
    let dir = tmp.join("density");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("1000.json"), run.to_string()).unwrap();
    let out = Command::new("/usr/bin/python3")
        .arg(repo().join("scripts/bench_report.py"))
        .arg(repo().join("crates/stord-bench/tests/fixtures/report-sample.json"))
        .args(["--docs".as_ref(), tmp.join("docs").as_os_str()])
        .args(["--readme".as_ref(), tmp.join("no-readme.md").as_os_str()])
        .args(["--density".as_ref(), dir.as_os_str()])
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(tmp.join("docs/benchmarks.md")).unwrap()
}

#[test]
fn density_section_weighs_stord_against_the_cheapest_qsd_with_no_better_tail() {
    let tmp = std::env::temp_dir().join(format!("stord-report-density-{}", std::process::id()));
    // qsd is cheapest but has the better p99; qsd-poll0's p99 is no better than stord's, so
    // stord is weighed against qsd-poll0: medians 60 against 100 ms/s, 0.60x, target met;
    // the interval is stord's extremes over qsd-poll0's: 50/110 and 70/90.
    let run = density_run(&[
        ("stord", &[(50.0, 900.0), (70.0, 1100.0)]),
        ("qsd", &[(55.0, 500.0), (65.0, 700.0)]),
        ("qsd-poll0", &[(90.0, 1000.0), (110.0, 1400.0)]),
    ]);
    let page = density_page(&tmp, &run);
    let section = &page[page.find("## Density").expect("no density section")..];
    let verdict = section
        .lines()
        .find(|l| l.starts_with("- x8:"))
        .unwrap_or_else(|| panic!("no verdict for 8 exports:\n{section}"));
    assert!(
        verdict.contains("0.60× the CPU") && verdict.contains("qsd-poll0"),
        "{verdict}"
    );
    assert!(verdict.contains("[0.45–0.78]"), "{verdict}");
    assert!(
        verdict.ends_with("met") && !verdict.contains("not met"),
        "{verdict}"
    );
    assert!(
        section.contains("| 8 | stord | 375 | 60 [50–70] |"),
        "{section}"
    );
    assert!(is_png(&tmp.join("docs/plots/density.png")));
    assert!(section.contains("plots/density.png"));

    // With every qsd set-up's tail better, the cheapest is taken and the verdict says so.
    let run = density_run(&[
        ("stord", &[(80.0, 3000.0), (80.0, 3000.0)]),
        ("qsd", &[(100.0, 500.0), (100.0, 700.0)]),
    ]);
    let page = density_page(&tmp, &run);
    assert!(
        page.contains("0.80× the CPU of the cheapest qsd set-up (every one has a better p99), qsd")
            && page.contains("target 0.70×: not met"),
        "{page}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
