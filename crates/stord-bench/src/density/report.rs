//! The density benchmark as Markdown: a table per (transport, backend, variant) with each
//! daemon's medians over the repetitions (CPU with its range), and per shape the verdict
//! the issue asks for: stord's CPU over that of the cheapest qsd set-up whose p99 is no
//! better than stord's, with the interval the repetitions' extremes give.

use std::fmt::Write as _;

use super::{Density, Row, Run};
use crate::matrix::median;

fn med(r: &Row, f: impl Fn(&Run) -> f64) -> f64 {
    median(r.runs.iter().map(f).collect())
}

fn range(r: &Row, f: impl Fn(&Run) -> f64) -> (f64, f64) {
    let v: Vec<f64> = r.runs.iter().map(f).collect();
    (
        v.iter().cloned().fold(f64::INFINITY, f64::min),
        v.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
    )
}

/// The whole result: the one-export maxima (when the load was derived from them rather than
/// given with `--total-iops`), then the tables.
pub fn markdown(d: &Density) -> String {
    let mut s = String::new();
    if !d.maxima.is_empty() {
        s.push_str("One-export QD1 maxima the loads derive from:\n\n");
    }
    for (t, b, daemon, iops) in &d.maxima {
        let _ = writeln!(s, "- {t}, {b}, {daemon}: {iops:.0} IOPS");
    }
    let mut groups: Vec<(&str, &str, &str)> = Vec::new();
    for r in &d.rows {
        let k = (r.transport, r.backend.as_str(), r.variant);
        if !groups.contains(&k) {
            groups.push(k);
        }
    }
    for (t, b, v) in groups {
        let g: Vec<&Row> = d
            .rows
            .iter()
            .filter(|r| r.transport == t && r.backend == b && r.variant == v)
            .collect();
        let _ = writeln!(s, "\n### {t}, {b}, {v}\n");
        table(&mut s, &g);
        s.push('\n');
        for line in verdicts(&g) {
            let _ = writeln!(s, "- {line}");
        }
    }
    s
}

fn table(s: &mut String, g: &[&Row]) {
    s.push_str(
        "| IoThreads | daemon | IOPS per client | CPU ms/s [range] | CPU µs/IO | p50 µs | \
         p99 µs | p99.9 µs | worst client p99 µs | flat-out IOPS | RSS KiB/export | idle ms | \
         short clients |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in g {
        let (lo, hi) = range(r, |x| x.cpu_ms_per_s);
        let flat = r
            .runs
            .iter()
            .filter_map(|x| x.flat_iops)
            .collect::<Vec<_>>();
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.0} [{lo:.0}-{hi:.0}] | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {} | {} |",
            r.shape,
            r.daemon,
            r.rate_per_client,
            med(r, |x| x.cpu_ms_per_s),
            med(r, |x| x.cpu_us_per_io),
            med(r, |x| x.p50_us),
            med(r, |x| x.p99_us),
            med(r, |x| x.p999_us),
            med(r, |x| x.worst_p99_us),
            if flat.is_empty() {
                "-".into()
            } else {
                format!("{:.0}", median(flat))
            },
            med(r, |x| x.rss_kib_per_export),
            r.idle_ms.map_or("-".into(), |ms| format!("{ms:.3}")),
            r.runs.iter().map(|x| x.short_clients).sum::<usize>(),
        );
    }
}

/// Per shape: stord (the first stord set-up) against the cheapest qsd set-up whose p99 is
/// no better than stord's; in the flat-out variant, the flat-out client's IOPS too.
fn verdicts(g: &[&Row]) -> Vec<String> {
    let mut shapes: Vec<usize> = g.iter().map(|r| r.shape).collect();
    shapes.dedup();
    let mut out = Vec::new();
    for n in shapes {
        let at: Vec<&&Row> = g.iter().filter(|r| r.shape == n).collect();
        let Some(ours) = at.iter().find(|r| r.daemon.starts_with("stord")) else {
            continue;
        };
        let qsds: Vec<&&&Row> = at.iter().filter(|r| r.daemon.starts_with("qsd")).collect();
        let p99 = med(ours, |x| x.p99_us);
        let worse: Vec<&&&Row> = qsds
            .iter()
            .filter(|r| med(r, |x| x.p99_us) >= p99)
            .cloned()
            .collect();
        let (pool, note) = if worse.is_empty() {
            (
                qsds.clone(),
                "the cheapest qsd set-up (every one has a better p99)",
            )
        } else {
            (worse, "the cheapest qsd set-up with a p99 no better")
        };
        let Some(theirs) = pool
            .iter()
            .min_by(|a, b| med(a, |x| x.cpu_ms_per_s).total_cmp(&med(b, |x| x.cpu_ms_per_s)))
        else {
            continue;
        };
        out.push(cpu_verdict(n, ours, theirs, note));
        if let Some(line) = flat_verdict(ours, &qsds) {
            out.push(line);
        }
    }
    out
}

/// Issue 60's target: stord's CPU at most this share of the qsd set-up it is weighed against.
const TARGET_CPU_RATIO: f64 = 0.70;

fn cpu_verdict(n: usize, ours: &Row, theirs: &Row, note: &str) -> String {
    let (alo, ahi) = range(ours, |x| x.cpu_ms_per_s);
    let (blo, bhi) = range(theirs, |x| x.cpu_ms_per_s);
    let ratio = med(ours, |x| x.cpu_ms_per_s) / med(theirs, |x| x.cpu_ms_per_s);
    format!(
        "x{n}: {} uses {ratio:.2}x the CPU of {note}, {} [{:.2}-{:.2}]; p99 {:.0} µs \
         against {:.0} µs; target {TARGET_CPU_RATIO:.2}x {}",
        ours.daemon,
        theirs.daemon,
        alo / bhi,
        ahi / blo,
        med(ours, |x| x.p99_us),
        med(theirs, |x| x.p99_us),
        if ratio <= TARGET_CPU_RATIO {
            "met"
        } else {
            "not met"
        },
    )
}

fn flat_verdict(ours: &Row, qsds: &[&&&Row]) -> Option<String> {
    let flat = |r: &Row| {
        let v: Vec<f64> = r.runs.iter().filter_map(|x| x.flat_iops).collect();
        (!v.is_empty()).then(|| median(v))
    };
    let mine = flat(ours)?;
    let best = qsds
        .iter()
        .filter_map(|r| Some((flat(r)?, r.daemon.as_str())))
        .max_by(|a, b| a.0.total_cmp(&b.0))?;
    Some(format!(
        "x{}: the flat-out client gets {mine:.0} IOPS from {}, {:.0} from {} ({:.2}x)",
        ours.shape,
        ours.daemon,
        best.0,
        best.1,
        mine / best.0
    ))
}
