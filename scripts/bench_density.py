"""The density section of docs/benchmarks.md, from `stord-bench density` runs.

`stord-bench density` writes one JSON file per run under results/density/ (many IoThreads,
one export each, every client paced at a low rate: issue 60). Unlike the report's matrix,
density runs are made by hand, a few shapes at a time, so this section reads every run in
that directory: a table per run (newest first), each ratio computed within its run, and
one plot of CPU and p99 against the number of IoThreads, each point from the newest run
that measured it. Imported by bench_report.py, whose helpers (tables, colours, plots, run
ranges) it uses through the module it is handed.
"""

import datetime
import glob
import json
import os
import statistics

# What stord's CPU must be at most, against the qsd set-up it is weighed with (issue 60).
TARGET_CPU_RATIO = 0.70

INTRO = (
    "Many light guests on one host: N IoThreads with one export each, every client reading "
    "4k at QD1 at a low paced rate (the total offered load below half of the slower "
    "daemon's one-export QD1 maximum), and in the flat-out variant one client unpaced among "
    "them. CPU is the daemon's user+system time over the measured time; latencies are "
    "pooled over the light clients (\"worst p99\" is the worst client's own); idle is the "
    "CPU over the idle period with every export connected and no I/O (schedstat). Medians "
    "over the repetitions, which alternate the daemons; the CPU range is the repetitions' "
    "extremes. The verdict weighs stord against the cheapest qsd set-up whose p99 is no "
    "better than stord's (if every qsd set-up has a better p99, against the cheapest)."
)

PLOT_NOTE = (
    "Each point of the plot comes from the newest run that measured its shape and variant; "
    "how noisy this VM is changes from hour to hour, so compare the daemons at one shape "
    "(measured in one run, alternating) rather than one shape with another."
)


def load_runs(density_dir):
    """Every run in `density_dir`, newest first, as (path, data)."""
    runs = []
    for path in glob.glob(os.path.join(density_dir, "*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance((data.get("result") or {}).get("rows"), list):
            runs.append((path, data))
    runs.sort(key=lambda r: r[1].get("unix_time") or 0, reverse=True)
    return runs


def med(row, field):
    vals = [r.get(field) for r in row.get("runs") or [] if isinstance(r.get(field), (int, float))]
    return statistics.median(vals) if vals else None


def fmt(x, digits=0):
    return "–" if x is None else f"{x:,.{digits}f}"


def groups(rows):
    """Rows by (transport, backend, variant), in the order they first appear."""
    out = {}
    for r in rows:
        out.setdefault((r.get("transport"), r.get("backend"), r.get("variant")), []).append(r)
    return out


def table(rows, report):
    body = []
    for r in rows:
        lo, hi = report.runs_range(r, "cpu_ms_per_s") or (None, None)
        flat = med(r, "flat_iops")
        body.append([
            r.get("shape"), r.get("daemon"), fmt(r.get("rate_per_client")),
            f"{fmt(med(r, 'cpu_ms_per_s'))} [{fmt(lo)}–{fmt(hi)}]",
            fmt(med(r, "cpu_us_per_io"), 1), fmt(med(r, "p50_us")), fmt(med(r, "p99_us")),
            fmt(med(r, "p999_us")), fmt(med(r, "worst_p99_us")), fmt(flat),
            fmt(med(r, "rss_kib_per_export")),
            "–" if r.get("idle_ms") is None else f"{r['idle_ms']:.3f}",
            fmt(med(r, "short_clients")),
        ])
    return report.md_table(["IoThreads", "daemon", "IOPS per client", "CPU ms/s [range]", "CPU µs/IO",
                     "p50 µs", "p99 µs", "p99.9 µs", "worst p99 µs", "flat-out IOPS",
                     "RSS KiB/export", "idle ms", "short clients"], body, left=2)


def verdicts(rows, report):
    """Per shape: stord's CPU over the qsd set-up the target weighs it against."""
    out = []
    for n in sorted({r.get("shape") for r in rows}):
        at = [r for r in rows if r.get("shape") == n]
        ours = next((r for r in at if str(r.get("daemon")).startswith("stord")), None)
        qsds = [r for r in at if str(r.get("daemon")).startswith("qsd")]
        if ours is None or not qsds or med(ours, "cpu_ms_per_s") is None:
            continue
        p99 = med(ours, "p99_us")
        worse = [r for r in qsds if (med(r, "p99_us") or 0) >= (p99 or 0)]
        pool = worse or qsds
        theirs = min(pool, key=lambda r: med(r, "cpu_ms_per_s") or float("inf"))
        a, b = med(ours, "cpu_ms_per_s"), med(theirs, "cpu_ms_per_s")
        if not b:
            continue
        alo, ahi = report.runs_range(ours, "cpu_ms_per_s")
        blo, bhi = report.runs_range(theirs, "cpu_ms_per_s")
        ratio = a / b
        against = ("the cheapest qsd set-up with a p99 no better" if worse else
                   "the cheapest qsd set-up (every one has a better p99)")
        line = (f"- x{n}: {ours['daemon']} uses {ratio:.2f}× the CPU of {against}, "
                f"{theirs['daemon']} [{alo / bhi:.2f}–{ahi / blo:.2f}]; p99 {fmt(p99)} µs "
                f"against {fmt(med(theirs, 'p99_us'))} µs; target {TARGET_CPU_RATIO:.2f}×: "
                + ("met" if ratio <= TARGET_CPU_RATIO else "not met"))
        mine = med(ours, "flat_iops")
        best = max(((med(r, "flat_iops"), r["daemon"]) for r in qsds
                    if med(r, "flat_iops") is not None), default=None)
        if mine is not None and best:
            line += (f"; the flat-out client gets {fmt(mine)} IOPS from stord, "
                     f"{fmt(best[0])} from {best[1]} ({mine / best[0]:.2f}×)")
        out.append(line)
    return out


def run_heading(path, data):
    when = "–"
    if isinstance(data.get("unix_time"), (int, float)):
        when = datetime.datetime.fromtimestamp(
            data["unix_time"], datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if isinstance(data.get("total_iops"), (int, float)):
        load = f"{data['total_iops']:.0f} IOPS offered in all"
    elif isinstance(data.get("load"), (int, float)):
        load = f"{data['load']:g} of the slower one-export maximum offered in all"
    else:
        load = "–"
    return (f"### Run of {when}: {data.get('runtime_s')} s runs, {data.get('reps')} "
            f"repetitions, {load}, kernel {data.get('kernel', '–')}"
            f" ([`{os.path.basename(path)}`](../results/density/{os.path.basename(path)}))")


def newest_points(runs):
    """(transport, backend, variant, daemon) -> {shape: (cpu ms/s, p99 µs)}, each point from
    the newest run that measured it."""
    out = {}
    for _, data in runs:  # newest first: the first value seen wins
        for r in data["result"]["rows"]:
            key = (r.get("transport"), r.get("backend"), r.get("variant"), r.get("daemon"))
            pts = out.setdefault(key, {})
            if r.get("shape") not in pts and med(r, "cpu_ms_per_s") is not None:
                pts[r["shape"]] = (med(r, "cpu_ms_per_s"), med(r, "p99_us"))
    return out


def plot(runs, plots_dir, written, report):
    """density.png: CPU and p99 against IoThreads; None when nothing is plottable."""
    points = newest_points(runs)
    if not points:
        return None
    colour = report.colour
    fig, (cpu_ax, p99_ax) = report.plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    cases = sorted({(t, b, v) for t, b, v, _ in points}, key=lambda c: (c[0], c[1], c[2] != "light"))
    ticks = sorted({s for pts in points.values() for s in pts})
    for (t, b, v, daemon), pts in sorted(points.items()):
        shapes = sorted(pts)
        ls = styles[cases.index((t, b, v)) % len(styles)]
        label = f"{daemon} ({v})" if len({(c[0], c[1]) for c in cases}) == 1 else \
            f"{daemon} ({t}, {b}, {v})"
        cpu_ax.plot(shapes, [pts[s][0] for s in shapes], ls, marker="o", color=colour(daemon),
                    label=label)
        p99_ax.plot(shapes, [pts[s][1] for s in shapes], ls, marker="o", color=colour(daemon),
                    label=label)
    for ax, ylabel in ((cpu_ax, "daemon CPU, ms per second"), (p99_ax, "pooled p99, µs")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("IoThreads (one export each)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    p99_ax.set_yscale("log")
    cpu_ax.set_ylim(bottom=0)
    cpu_ax.legend(fontsize=8)
    cpu_ax.set_title("daemon CPU; flat-out adds one unpaced client (lower is better)")
    p99_ax.set_title("p99 of the light clients (lower is better)")
    fig.tight_layout()
    path = os.path.join(plots_dir, "density.png")
    report.save(fig, path, written)
    return path


def section(density_dir, plots_dir, written, report):
    """The section's lines (heading, plot, a table per run); `report` is bench_report."""
    out = ["## Density", "", INTRO, ""]
    runs = load_runs(density_dir)
    if not runs:
        return out + ["(no `stord-bench density` run in results/density)", ""]
    if plot(runs, plots_dir, written, report):
        out += ["![density: CPU and p99 against IoThreads](plots/density.png)", "",
                PLOT_NOTE, ""]
    for path, data in runs:
        out += [run_heading(path, data), ""]
        maxima = data["result"].get("maxima") or []
        if maxima:
            out += ["One-export QD1 maxima: " + "; ".join(
                f"{m[0]}, {m[1]}, {m[2]} {fmt(m[3])} IOPS" for m in maxima
                if isinstance(m, list) and len(m) == 4) + ".", ""]
        for (t, b, v), rows in groups(data["result"]["rows"]).items():
            out += [f"{t}, {b}, {v}:", "", table(rows, report), ""]
            out += verdicts(rows, report) + [""]
    return out
