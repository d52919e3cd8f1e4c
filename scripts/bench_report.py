#!/usr/bin/env python3
"""Turn one `stord-bench report` run into docs/benchmarks.md, plots and README headlines.

Usage:
    /usr/bin/python3 scripts/bench_report.py RESULTS.json [--docs DIR] [--readme PATH]

`cargo run --release -p stord-bench -- report` writes one JSON file under results/report/
holding every figure of a full benchmark run (the export x backend x workload x daemon
matrix, polling policies vs offered load, a poll-window trace, linux-aio harvest sizes, the
wake-up scenario and the idle cost). This script is the only thing that turns that JSON into
prose, so the published tables, the plots and the README's headline always come from the
same run and are never edited by hand:

1. PNG plots in DIR/plots/ (stable names: a re-run overwrites them);
2. DIR/benchmarks.md, regenerated in full;
3. the README lines between `<!-- bench:headline -->` and `<!-- /bench:headline -->`;
4. the path of every file written, on stdout.

Every section is optional: a key that is absent or empty yields "(not measured in this run)",
and a null value prints as "–". Needs only the standard library and matplotlib (Agg).
"""

import argparse
import datetime
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

import bench_density  # noqa: E402  (beside this script)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_COMMAND = "cargo run --release -p stord-bench -- report"
MARK_BEGIN = "<!-- bench:headline -->"
MARK_END = "<!-- /bench:headline -->"
NA = "–"  # printed for null / missing values
NOT_MEASURED = "(not measured in this run)"

# Display order; values not listed here are appended after these, sorted by name.
EXPORTS = ["nbd", "fuse", "vhost-user-blk", "vhost-user-blk-libblkio", "vhost-user-blk-libblkio-poll"]
EXPORT_LABEL = {
    "nbd": "NBD",
    "fuse": "FUSE",
    "vhost-user-blk": "vhost-user-blk (stord-bench's frontend)",
    "vhost-user-blk-libblkio": "vhost-user-blk (libblkio)",
    "vhost-user-blk-libblkio-poll": "vhost-user-blk (libblkio poll queues)",
    "raw": "raw file",
}
BACKENDS = ["null", "file-io_uring", "dev", "file-native", "file-threads", "file"]
BACKEND_LABEL = {
    "null": "null",
    "file-io_uring": "file (io_uring)",
    "file-native": "file (linux-aio)",
    "file-threads": "file (threads)",
    "file": "file",
    "dev": "fast device (loop, direct I/O over tmpfs)",
}
DAEMONS = ["stord-off", "stord-classic", "stord-weighted", "stord-haltpoll",
           "qsd", "qsd-poll0", "nbdkit", "fio-raw"]
WORKLOAD_ORDER = {"randread": 0, "randwrite": 1, "read": 2, "write": 3}

# One colour per daemon in every plot: stord policies in blues, qsd in oranges, nbdkit
# green, fio on the raw file grey.
DAEMON_COLOUR = {
    "stord": "#2171b5",
    "stord-poll0": "#9ecae1",
    "stord-off": "#9ecae1",
    "stord-classic": "#4a98c9",
    "stord-weighted": "#1f5fa8",
    "stord-haltpoll": "#08306b",
    "qsd": "#fd8d3c",
    "qsd-poll0": "#a63603",
    "nbdkit": "#31a354",
    "fio-raw": "#8c8c8c",
}
EXTRA_COLOURS = ["#9467bd", "#e377c2", "#bcbd22", "#17becf", "#8c564b", "#d62728"]

DPI = 100


# ---------------------------------------------------------------- small helpers


def num(x):
    """x as a float, or None when it is null / not a number."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def ratio(a, b):
    a, b = num(a), num(b)
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratio_interval(a_row, b_row, field="iops"):
    """The ratio a/b over the repetitions: (lowest, highest) from the runs' min and max, or
    None without runs on both sides."""
    a = runs_range(a_row or {}, field)
    b = runs_range(b_row or {}, field)
    if a is None or b is None or b[0] <= 0 or b[1] <= 0:
        return None
    return a[0] / b[1], a[1] / b[0]


def verdict(iv, higher_is_better=True):
    """'ahead' / 'behind' when the interval lies wholly above / below 1, else 'within
    noise'; for CPU (lower is better) the words swap."""
    if iv is None:
        return NA
    lo, hi = iv
    if lo > 1:
        return "ahead" if higher_is_better else "costlier"
    if hi < 1:
        return "behind" if higher_is_better else "cheaper"
    return "within noise"


def fmt_iv(iv):
    return NA if iv is None else f"[{iv[0]:.2f}–{iv[1]:.2f}]"


def fmt_ratio_iv(a_row, b_row, field="iops"):
    """The ratio of medians with its interval over the repetitions: "0.63× [0.55–0.70]"."""
    r = ratio((a_row or {}).get(field), (b_row or {}).get(field))
    if r is None:
        return NA
    iv = ratio_interval(a_row, b_row, field) if a_row and b_row else None
    return fmt_ratio(r) + ("" if iv is None else " " + fmt_iv(iv))


def fmt_int(x):
    x = num(x)
    return NA if x is None else f"{x:,.0f}"


def fmt_ratio(x):
    x = num(x)
    return NA if x is None else f"{x:.2f}×"


def fmt_val(x):
    """Three-ish significant digits for latencies, CPU, MB/s."""
    x = num(x)
    if x is None:
        return NA
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_g(x):
    x = num(x)
    return NA if x is None else f"{x:g}"


def fmt_pct(x):
    x = num(x)
    return NA if x is None else f"{100 * x:.1f}"


def fmt_s(x):
    x = num(x)
    return NA if x is None else f"{x:.3f}"


def fmt_duration(s):
    s = num(s)
    if s is None:
        return NA
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    if h:
        return f"{h} h {m} min {sec} s"
    if m:
        return f"{m} min {sec} s"
    return f"{s:.1f} s"


def fmt_bytes(n):
    n = num(n)
    if n is None:
        return NA
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def si(x, _pos=None):
    """Tick formatter: 0, 500, 20k, 1.2M."""
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1e6:
        return f"{x / 1e6:g}M"
    if a >= 1e3:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


def ordered(values, order):
    """Unique values, known ones in `order` first, the rest sorted."""
    seen = list(dict.fromkeys(values))
    known = [v for v in order if v in seen]
    return known + sorted(v for v in seen if v not in order)


def md_table(headers, rows, left=1):
    """A markdown table; the first `left` columns are left-aligned, the rest right-aligned."""
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" if i < left else "---:" for i in range(len(headers))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def export_label(e):
    return EXPORT_LABEL.get(e, e)


def backend_label(b):
    return BACKEND_LABEL.get(b, b)


def bs_bytes(bs):
    s = str(bs).strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    try:
        return float(s.rstrip("kmg")) * mult
    except ValueError:
        return 0.0


# A "case" is (workload, bs, iodepth): the column of the full tables and the x of the bars.
def case_of(row):
    return (row.get("workload"), row.get("bs"), row.get("iodepth"))


def case_key(case):
    w, bs, qd = case
    return (bs_bytes(bs), -(num(qd) or 0), WORKLOAD_ORDER.get(w, 99), str(w))


def case_label(case, sep=" "):
    w, bs, qd = case
    return f"{bs} {w}{sep}QD{qd}"


class Colours:
    """Daemon -> colour, stable within one run even for daemons not in DAEMON_COLOUR."""

    def __init__(self):
        self.extra = {}

    def __call__(self, daemon):
        if daemon in DAEMON_COLOUR:
            return DAEMON_COLOUR[daemon]
        if daemon not in self.extra:
            self.extra[daemon] = EXTRA_COLOURS[len(self.extra) % len(EXTRA_COLOURS)]
        return self.extra[daemon]


colour = Colours()


def title_and_legend(fig, title, handles, ncol):
    """Suptitle and one shared legend above the subplots, in a fixed band of inches."""
    h = fig.get_figheight()
    fig.suptitle(title, y=1 - 0.12 / h, va="top")
    fig.legend(handles=handles, loc="upper center", ncol=ncol, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.42 / h))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.62 / h))


def save(fig, path, written):
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    written.append(path)


# ---------------------------------------------------------------- the matrix


class Matrix:
    """Index over the matrix rows: lookups by (export, backend, case, daemon)."""

    def __init__(self, rows, pinned=False):
        self.rows = [r for r in rows or []
                     if isinstance(r, dict) and bool(r.get("pinned")) == pinned]
        self.by_key = {}
        for r in self.rows:
            key = (r.get("export"), r.get("backend"), case_of(r), r.get("daemon"))
            self.by_key.setdefault(key, r)
        self.raw_rows = [r for r in self.rows
                         if r.get("export") == "raw" or r.get("daemon") == "fio-raw"]
        self.raw_by_case = {}
        for r in self.raw_rows:
            if r.get("backend") != "dev":
                self.raw_by_case.setdefault(case_of(r), r)

    def exports(self):
        return ordered([r.get("export") for r in self.rows if r.get("export") != "raw"], EXPORTS)

    def backends(self, export):
        return ordered([r.get("backend") for r in self.rows if r.get("export") == export], BACKENDS)

    def cases(self, export, backend):
        cs = {case_of(r) for r in self.rows
              if r.get("export") == export and r.get("backend") == backend}
        return sorted(cs, key=case_key)

    def daemons(self, export, backend=None, case=None):
        return ordered([r.get("daemon") for r in self.rows
                        if r.get("export") == export
                        and (backend is None or r.get("backend") == backend)
                        and (case is None or case_of(r) == case)], DAEMONS)

    def get(self, export, backend, case, daemon):
        return self.by_key.get((export, backend, case, daemon))

    def raw(self, backend, case, export=None):
        """fio on the medium itself for a file or device backend's case; None for null
        backends. The run interleaves fio-raw with the daemons of each (export, backend), so
        prefer that row (the disk drifts over a run); fall back to any raw row of the case
        on the same kind of medium."""
        if not (str(backend).startswith("file") or backend == "dev"):
            return None
        own = self.by_key.get((export, backend, case, "fio-raw"))
        if own or backend == "dev":
            return own
        return self.raw_by_case.get(case)

    def best_stord(self, export, backend, case):
        """The stord-* row with the highest IOPS for this case."""
        best = None
        for d in self.daemons(export, backend, case):
            r = self.get(export, backend, case, d)
            if not str(d).startswith("stord") or num(r.get("iops")) is None:
                continue
            if best is None or num(r["iops"]) > num(best["iops"]):
                best = r
        return best


def policy_name(daemon):
    d = str(daemon)
    return d[len("stord-"):] if d.startswith("stord-") else d


# Headline cases: (backend, workload, bs, iodepth), shown when present.
HEADLINE_CASES = [
    ("null", ("randread", "4k", 16)),
    ("null", ("randwrite", "4k", 16)),
    ("null", ("randread", "4k", 1)),
    ("file-io_uring", ("randread", "4k", 16)),
    ("file-io_uring", ("read", "64k", 16)),
]


def headline_section(m):
    out = ["## Headline", "",
           "For each export and a few representative cases: the stord polling policy with the "
           "highest IOPS, its IOPS, and ratios against qemu-storage-daemon with default polling "
           "(\"qsd\") measured in the same run; \"× raw fio\" compares with fio on the image file "
           "directly (file backends only). Ratios above 1 mean more IOPS (or more CPU per I/O) "
           "than the reference. The interval runs from the lowest to the highest ratio the "
           "repetitions allow (stord's slowest run against qsd's fastest, and the reverse); the "
           "verdict is \"ahead\" or \"behind\" only when the whole interval lies above or "
           "below 1, else \"within noise\".", ""]
    exports = m.exports()
    if not exports:
        return out + [NOT_MEASURED, ""]
    for e in exports:
        rows = []
        for backend, case in HEADLINE_CASES:
            best = m.best_stord(e, backend, case)
            if best is None:
                continue
            qsd = m.get(e, backend, case, "qsd") or {}
            raw = m.raw(backend, case, e) or {}
            iv = ratio_interval(best, qsd) if qsd else None
            rows.append([f"{backend_label(backend)}, {case_label(case)}",
                         policy_name(best.get("daemon")),
                         fmt_int(best.get("iops")),
                         fmt_ratio(ratio(best.get("iops"), qsd.get("iops"))),
                         fmt_iv(iv), verdict(iv),
                         fmt_ratio_iv(best, raw),
                         fmt_ratio_iv(best, qsd, "cpu_us_per_io")])
        out += [f"### {export_label(e)}", ""]
        if rows:
            out += [md_table(["case", "best stord policy", "IOPS", "× qsd", "interval",
                              "vs qsd", "× raw fio", "CPU µs/IO × qsd"], rows, left=2), ""]
        else:
            out += [NOT_MEASURED, ""]
    return out


def placement_section(rows):
    """The headline cases with daemon and client pinned to separate CPUs, beside the same
    cases floating: each stord policy's ratio to qsd under both placements."""
    pm = Matrix(rows, pinned=True)
    if not pm.rows:
        return []
    fm = Matrix(rows)
    out = ["## Placement: pinned and floating", "",
           "On this 2-vCPU VM a wake-up across CPUs costs tens of µs, so where the scheduler "
           "puts the daemon and the client moves the results. The headline cases were run "
           "again with every daemon's threads on CPU 1 and the client on CPU 0 (taskset, "
           "fio's cpus_allowed), every daemon alike; \"floating\" is the same case from the "
           "tables above.", ""]
    headers = ["case", "daemon", "floating × qsd", "interval", "verdict", "pinned IOPS",
               "pinned × qsd", "interval", "verdict"]
    for e in pm.exports():
        table = []
        for c in pm.cases(e, "null"):
            fq = fm.get(e, "null", c, "qsd") or {}
            pq = pm.get(e, "null", c, "qsd") or {}
            for d in pm.daemons(e, "null", c):
                if d == "qsd":
                    continue
                f = fm.get(e, "null", c, d) or {}
                p_ = pm.get(e, "null", c, d) or {}
                fiv = ratio_interval(f, fq) if f and fq else None
                piv = ratio_interval(p_, pq) if p_ and pq else None
                table.append([case_label(c), d,
                              fmt_ratio(ratio(f.get("iops"), fq.get("iops"))), fmt_iv(fiv),
                              verdict(fiv), fmt_int(p_.get("iops")),
                              fmt_ratio(ratio(p_.get("iops"), pq.get("iops"))), fmt_iv(piv),
                              verdict(piv)])
        out += [f"### {export_label(e)}, null backend", "", md_table(headers, table, left=2),
                ""]
    return out


def comparable(params):
    """A full run (not --quick) of at least 5 s x 3, whose verdicts mean something."""
    params = params or {}
    return (not params.get("quick") and (num(params.get("runtime_s")) or 0) >= 5
            and (num(params.get("reps")) or 0) >= 3)


def previous_run(data, results_dir):
    """The latest comparable run in `results_dir` before this one, or None."""
    me = num(data.get("unix_time"))
    best = None
    try:
        names = os.listdir(results_dir)
    except OSError:
        return None
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(results_dir, name), encoding="utf-8") as f:
                other = json.load(f)
        except (OSError, ValueError):
            continue
        t = num(other.get("unix_time"))
        if t is None or (me is not None and t >= me) or not comparable(other.get("params")):
            continue
        if best is None or t > num(best.get("unix_time")):
            best = other
    return best


def verdicts(data, pinned=False):
    """{(export, backend, case, daemon): verdict against qsd} for every stord row."""
    m = Matrix(data.get("matrix"), pinned=pinned)
    out = {}
    for r in m.rows:
        d = str(r.get("daemon"))
        if not d.startswith("stord"):
            continue
        key = (r.get("export"), r.get("backend"), case_of(r))
        qsd = m.get(*key, "qsd")
        iv = ratio_interval(r, qsd) if qsd else None
        if iv is not None:
            out[key + (d,)] = verdict(iv)
    return out


def comparison_section(data, results_dir):
    """How this run's verdicts against qsd compare with the previous full run's."""
    if not comparable(data.get("params")):
        return []
    prev = previous_run(data, results_dir)
    out = ["## Against the previous full run", ""]
    if prev is None:
        return out + ["No earlier full run (5 s x 3 or longer) to compare with.", ""]
    when = datetime.datetime.fromtimestamp(
        num(prev["unix_time"]), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows, same, total = [], 0, 0
    for pinned in (False, True):
        now, then = verdicts(data, pinned), verdicts(prev, pinned)
        for key in sorted(set(now) & set(then), key=str):
            total += 1
            if now[key] == then[key]:
                same += 1
                continue
            e, b, c, d = key
            rows.append([export_label(e), backend_label(b), case_label(c), d,
                         "pinned" if pinned else "floating", then[key], now[key]])
    out += [f"Every verdict of a stord policy against qsd that both this run and the run of "
            f"{when} (`{prev.get('results_path', '?')}`) made: {same} of {total} agree.", ""]
    if rows:
        out += ["The ones that changed. A change between \"within noise\" and a side means "
                "the intervals grazed 1 in one of the runs; a change from one side to the "
                "other would be a real disagreement.", "",
                md_table(["export", "backend", "case", "daemon", "placement", "before", "now"],
                         rows, left=5), ""]
    return out


def runs_range(row, field):
    """(min, max) of runs[].field, or None."""
    vals = [num(r.get(field)) for r in row.get("runs") or [] if isinstance(r, dict)]
    vals = [v for v in vals if v is not None]
    return (min(vals), max(vals)) if vals else None


def bar_plot(m, export, field, ylabel, title, path, written, with_raw):
    """One subplot per backend; x = cases, grouped bars per daemon, error bars min-max."""
    backends = m.backends(export)
    daemons = [d for d in m.daemons(export) if d != "fio-raw"]
    n = len(backends)
    ncols = min(n, 2)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(12.5, 4.4 * nrows + 0.8), squeeze=False)
    legend = {}
    for i, backend in enumerate(backends):
        ax = axes[i // ncols][i % ncols]
        cases = m.cases(export, backend)
        has_raw = with_raw and any(m.raw(backend, c, export) for c in cases)
        slots = daemons + (["fio-raw"] if has_raw else [])
        width = 0.8 / max(len(slots), 1)
        for j, d in enumerate(slots):
            xs, ys, lo, hi = [], [], [], []
            for k, c in enumerate(cases):
                row = m.raw(backend, c, export) if d == "fio-raw" else m.get(export, backend, c, d)
                v = num((row or {}).get(field))
                if v is None:
                    # Say so rather than leave a silent gap (row absent or value null).
                    ax.text(k - 0.4 + width * (j + 0.5), 0.02, "n/a", rotation=90, ha="center",
                            va="bottom", fontsize=8, color="#555555",
                            transform=ax.get_xaxis_transform())
                    continue
                rng = runs_range(row, field) or (v, v)
                xs.append(k - 0.4 + width * (j + 0.5))
                ys.append(v)
                lo.append(max(v - rng[0], 0))
                hi.append(max(rng[1] - v, 0))
            if not xs:
                continue
            raw_bar = d == "fio-raw"
            label = "fio on the raw file" if raw_bar else d
            ax.bar(xs, ys, width * 0.92, color=colour(d), label=label,
                   hatch="//" if raw_bar else None, edgecolor="white" if raw_bar else None,
                   yerr=[lo, hi], capsize=2, error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
            legend.setdefault(label, Patch(facecolor=colour(d), hatch="//" if raw_bar else None,
                                           edgecolor="white" if raw_bar else None, label=label))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([case_label(c, "\n") for c in cases])
        ax.set_xlim(-0.6, len(cases) - 0.4)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(si))
        ax.set_ylabel(ylabel)
        ax.set_title(f"{export_label(export)}, {backend_label(backend)} backend")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    for i in range(n, nrows * ncols):
        axes[i // ncols][i % ncols].set_visible(False)
    title_and_legend(fig, title, list(legend.values()), min(len(legend), 8))
    save(fig, path, written)


def export_section(m, export, plots_dir, written, reps):
    out = [f"## {export_label(export)}", "",
           f"Every daemon measured through the {export_label(export)} export, medians over the "
           "repetitions. \"× qsd\" and \"CPU × qsd\" compare with qsd (default polling) on the "
           "same case; \"× raw fio\" compares with fio on the image file for the same workload "
           "(file backends only). CPU µs/IO is the daemon's user+sys CPU time divided by the "
           "I/Os completed; spread is (max-min)/median of IOPS over the repetitions.", ""]
    raw_spreads = [num(r.get("iops_spread")) for r in m.raw_rows
                   if r.get("export") == export and num(r.get("iops_spread")) is not None]
    if raw_spreads:
        out += [f"Caution with the file backends: fio on the raw file itself, measured between "
                f"these daemons, varies by {min(raw_spreads) * 100:.0f}-"
                f"{max(raw_spreads) * 100:.0f} % between its repetitions in this run (the "
                "virtual disk's speed swings within seconds), so file-backend ratios from short "
                "runs are indicative only; the null backend measures the daemons themselves.",
                ""]
    headers = ["case", "daemon", "IOPS", "× qsd", "interval", "vs qsd", "× raw fio", "MB/s",
               "p50 µs", "p99 µs", "CPU µs/IO", "CPU × qsd", "spread %"]
    for backend in m.backends(export):
        rows = []
        for c in m.cases(export, backend):
            qsd = m.get(export, backend, c, "qsd") or {}
            raw = m.raw(backend, c, export) or {}
            for d in m.daemons(export, backend, c):
                r = m.get(export, backend, c, d)
                iv = ratio_interval(r, qsd) if qsd and d != "qsd" else None
                rows.append([case_label(c), d, fmt_int(r.get("iops")),
                             fmt_ratio(ratio(r.get("iops"), qsd.get("iops"))),
                             fmt_iv(iv), verdict(iv) if iv else NA,
                             fmt_ratio_iv(r, raw),
                             fmt_val(r.get("mbps")), fmt_val(r.get("p50_us")),
                             fmt_val(r.get("p99_us")), fmt_val(r.get("cpu_us_per_io")),
                             fmt_ratio_iv(r, qsd, "cpu_us_per_io") if d != "qsd" else
                             fmt_ratio(ratio(r.get("cpu_us_per_io"), qsd.get("cpu_us_per_io"))),
                             fmt_pct(r.get("iops_spread"))])
        out += [f"### {export_label(export)}, {backend_label(backend)} backend", "",
                md_table(headers, rows, left=2), ""]

    slug = export.replace("/", "-")
    rep_note = f"median of {reps} reps" if reps else "median of the reps"
    iops_png = os.path.join(plots_dir, f"iops-{slug}.png")
    bar_plot(m, export, "iops", "IOPS (higher is better)",
             f"{export_label(export)}: IOPS per daemon ({rep_note}; error bars = min–max)",
             iops_png, written, with_raw=True)
    cpu_png = os.path.join(plots_dir, f"cpu-{slug}.png")
    bar_plot(m, export, "cpu_us_per_io", "daemon CPU µs per I/O (lower is better)",
             f"{export_label(export)}: daemon CPU (user+sys) per I/O ({rep_note}; "
             "error bars = min–max)", cpu_png, written, with_raw=False)
    out += ["IOPS per backend and case; the hatched grey bar on file backends is fio on the "
            "image file directly (no daemon), the ceiling a daemon can approach.", "",
            f"![{export_label(export)} IOPS per daemon](plots/{os.path.basename(iops_png)})", "",
            "Daemon CPU time (user+sys) per completed I/O; lower means cheaper I/O.", "",
            f"![{export_label(export)} CPU per I/O](plots/{os.path.basename(cpu_png)})", ""]
    return out


def raw_section(m):
    out = ["## fio on the raw file", "",
           "fio directly on the image file (io_uring, O_DIRECT, no daemon in the path): the "
           "floor for latency and the ceiling for IOPS that the file-backend rows above are "
           "compared to. It runs as one more \"daemon\" in every file-backend block, between "
           "the others, because the virtual disk's speed drifts during a run.",
           ""]
    if not m.raw_rows:
        return out + [NOT_MEASURED, ""]
    rows = []
    key = lambda r: (str(r.get("export")), str(r.get("backend")), case_key(case_of(r)))  # noqa: E731
    for r in sorted(m.raw_rows, key=key):
        rows.append([case_label(case_of(r)), f"{r.get('backend', NA)} ({r.get('export', NA)} block)",
                     fmt_int(r.get("iops")), fmt_val(r.get("mbps")), fmt_val(r.get("p50_us")),
                     fmt_val(r.get("p99_us")), fmt_pct(r.get("iops_spread"))])
    return out + [md_table(["case", "measured beside", "IOPS", "MB/s", "p50 µs", "p99 µs",
                            "spread %"], rows, left=2), ""]


# ---------------------------------------------------------------- polling vs load


def curves_section(curves, plots_dir, written):
    out = ["## Polling policies vs offered load", "",
           "NBD export, null backend, 4k randread at QD1, with fio sleeping a fixed think time "
           "between I/Os to lower the offered load. Short think times let a polling loop catch "
           "the next request without sleeping; long ones show what each policy does when "
           "spinning cannot pay off. Loop CPU is the daemon process's CPU time (user + system, "
           "all threads; the IoThread does nearly all of it) per second of wall time "
           "(1000 = one full core).", ""]
    curves = [c for c in curves or [] if isinstance(c, dict)]
    if not curves:
        return out + [NOT_MEASURED, ""]
    thinks = sorted({num(c.get("thinktime_us")) for c in curves
                     if num(c.get("thinktime_us")) is not None})
    daemons = ordered([c.get("daemon") for c in curves], DAEMONS)
    by = {(c.get("daemon"), num(c.get("thinktime_us"))): c for c in curves}
    rows = []
    for t in thinks:
        for d in daemons:
            c = by.get((d, t))
            if c is None:
                continue
            rows.append([f"{t:g}", d, fmt_int(c.get("iops")), fmt_val(c.get("p50_us")),
                         fmt_val(c.get("p99_us")), fmt_val(c.get("loop_cpu_ms_per_s"))])
    out += [md_table(["think µs", "daemon", "IOPS", "p50 µs", "p99 µs", "loop CPU ms/s"],
                     rows, left=2), ""]

    fig, axes = plt.subplots(1, 3, figsize=(14, 5.2))
    panels = [("p50_us", "p50 latency (µs)", "median latency"),
              ("p99_us", "p99 latency (µs)", "99th percentile latency"),
              ("loop_cpu_ms_per_s", "loop CPU (ms per s of wall time)", "loop CPU")]
    for ax, (field, ylabel, title) in zip(axes, panels):
        vals = []
        for d in daemons:
            xs = [i for i, t in enumerate(thinks) if num(by.get((d, t), {}).get(field)) is not None]
            ys = [num(by[(d, thinks[i])][field]) for i in xs]
            vals += ys
            if xs:
                ax.plot(xs, ys, marker="o", color=colour(d), label=d, linewidth=1.8)
        is_latency = field != "loop_cpu_ms_per_s"
        positive = [v for v in vals if v > 0]
        if is_latency and positive and max(positive) / min(positive) >= 20:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(si))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ylabel += ", log scale"
        else:
            ax.set_ylim(bottom=0)
        if not is_latency:
            ax.axhline(1000, color="#555555", linestyle=":", linewidth=1)
            ax.text(len(thinks) - 1, 1000, "one full core ", ha="right", va="bottom",
                    fontsize=8, color="#555555")
            ax.set_ylim(0, max([1100] + vals) * 1.05)
        ax.set_xticks(range(len(thinks)))
        ax.set_xticklabels([f"{t:g}" for t in thinks])
        ax.set_xlabel("fio thinktime between I/Os (µs)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both" if ax.get_yscale() == "log" else "major")
    handles, labels = axes[0].get_legend_handles_labels()
    title_and_legend(fig, "Polling policies vs offered load (NBD, null backend, 4k randread QD1)",
                     handles, max(len(labels), 1))
    path = os.path.join(plots_dir, "curves.png")
    save(fig, path, written)
    out += ["![latency and loop CPU vs think time](plots/curves.png)", ""]
    return out


def window_section(trace, plots_dir, written):
    out = ["## Poll window over time", ""]
    series = (trace or {}).get("series") or {}
    series = {k: v for k, v in series.items()
              if isinstance(v, dict) and v.get("t_ms") and v.get("window_ns")}
    desc = (trace or {}).get("description")
    out += [(desc.strip() + " " if desc else "") +
            "The plot shows each adaptive policy's poll window (how long the loop spins before "
            "sleeping) as the load alternates between the shaded phases and idle gaps.", ""]
    if not series:
        return out + [NOT_MEASURED, ""]
    fig, ax = plt.subplots(figsize=(12, 5.5))
    shade = {}
    shade_colours = ["#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1"]
    for p in (trace or {}).get("phases") or []:
        kind = p.get("kind", "")
        s, e = num(p.get("start_ms")), num(p.get("end_ms"))
        if kind == "idle" or s is None or e is None:
            continue
        if kind not in shade:
            shade[kind] = shade_colours[len(shade) % len(shade_colours)]
        ax.axvspan(s, e, color=shade[kind], alpha=0.6, linewidth=0, zorder=0)
    # Policies often sit on the same values (0, poll-max-ns): vary the line style too.
    styles = [("-", 2.4), ("--", 1.8), (":", 2.2), ("-.", 1.6)]
    for i, name in enumerate(ordered(series.keys(), [policy_name(d) for d in DAEMONS])):
        s = series[name]
        pts = [(num(t), num(w)) for t, w in zip(s["t_ms"], s["window_ns"])]
        pts = [(t, w / 1000.0) for t, w in pts if t is not None and w is not None]
        if not pts:
            continue
        daemon = name if str(name).startswith("stord") else f"stord-{name}"
        ls, lw = styles[i % len(styles)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], drawstyle="steps-post",
                color=colour(daemon), label=name, linestyle=ls, linewidth=lw)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(facecolor=c, alpha=0.6, label=k) for k, c in shade.items()]
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("poll window (µs)")
    ax.grid(alpha=0.3)
    title_and_legend(fig, "Adaptive poll window per policy over time", handles, len(handles))
    path = os.path.join(plots_dir, "poll-window.png")
    save(fig, path, written)
    out += ["![poll window over time](plots/poll-window.png)", ""]
    return out


# ---------------------------------------------------------------- linux-aio harvest


def harvest_section(harvest, plots_dir, written):
    out = ["## linux-aio completions per harvest", "",
           "With the linux-aio file backend, how many completions each harvest of the "
           "completion ring reaped, in power-of-two buckets, split by where the harvest "
           "happened (on the eventfd event, or right after submitting) and by whether reaping "
           "after submit was enabled. Bigger harvests mean fewer wake-ups per I/O; the plot "
           "shows each series as a share of its own harvests.", ""]
    harvest = harvest or {}
    labels = list(harvest.get("bucket_labels") or [])
    runs = [r for r in harvest.get("runs") or [] if isinstance(r, dict)]
    if not runs:
        return out + [NOT_MEASURED, ""]
    nb = max([len(labels)] + [len(r.get(k) or []) for r in runs
                              for k in ("on_event", "after_submit")])
    labels += [f"#{i}" for i in range(len(labels), nb)]

    series = []  # (label, counts, colour, iops, reap after submit?, harvest point)
    palette = {(True, "on_event"): "#2171b5", (True, "after_submit"): "#6baed6",
               (False, "on_event"): "#d94801", (False, "after_submit"): "#fdae6b"}
    for r in runs:
        reap = bool(r.get("reap_after_submit"))
        for k, name in (("on_event", "on event"), ("after_submit", "after submit")):
            counts = [num(v) or 0 for v in (r.get(k) or [])]
            counts += [0] * (nb - len(counts))
            series.append((f"{name}, reap-after-submit {'on' if reap else 'off'}", counts,
                           palette.get((reap, k), "#888888"), r.get("iops"), reap, name))

    rows = [[("on" if reap else "off"), name] + [fmt_int(v) for v in counts]
            + [fmt_int(sum(counts)), fmt_int(iops)]
            for _, counts, _, iops, reap, name in series]
    out += [md_table(["reap after submit", "harvest"] + labels + ["harvests", "IOPS"], rows,
                     left=2),
            "", "Bucket labels are completions reaped per harvest; IOPS is the run's "
            "throughput (the same run for both harvest points).", ""]

    fig, ax = plt.subplots(figsize=(12, 5.5))
    w = 0.8 / len(series)
    for j, (label, counts, col, _, _, _) in enumerate(series):
        total = sum(counts)
        shares = [100.0 * c / total if total else 0.0 for c in counts]
        ax.bar([i - 0.4 + w * (j + 0.5) for i in range(nb)], shares, w * 0.92, color=col,
               label=label + ("" if total else " (no harvests)"))
    ax.set_xticks(range(nb))
    ax.set_xticklabels(labels)
    ax.set_xlabel("completions reaped in one harvest")
    ax.set_ylabel("share of that series' harvests (%)")
    ax.set_ylim(bottom=0)
    ax.set_title("linux-aio: completions reaped per harvest")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path = os.path.join(plots_dir, "harvest.png")
    save(fig, path, written)
    out += ["![completions per harvest](plots/harvest.png)", ""]
    return out


# ---------------------------------------------------------------- wake-up and idle


def wakeup_raw(wakeup):
    for w in wakeup:
        if w.get("export") == "raw" or w.get("daemon") == "fio-raw":
            return w
    return None


def wakeup_section(wakeup, plots_dir, written):
    out = ["## Wake-up scenario", "",
           "Reads 128 MiB with O_DIRECT in 128 KiB chunks, in batches of 16, sleeping 1 ms "
           "before each batch and after each completion, so the daemon goes idle between "
           "requests and every request pays for waking it up. Lower is better; \"× raw file\" "
           "compares with the same reads on the image file directly.", ""]
    wakeup = [w for w in wakeup or [] if isinstance(w, dict)]
    if not wakeup:
        return out + [NOT_MEASURED, ""]
    raw = wakeup_raw(wakeup) or {}
    rows = []
    for w in wakeup:
        reps = ", ".join(fmt_s(s) for s in w.get("seconds") or []) or NA
        rows.append([w.get("target", NA), w.get("daemon", NA), fmt_s(w.get("median_s")), reps,
                     fmt_ratio(ratio(w.get("median_s"), raw.get("median_s")))])
    out += [md_table(["target", "daemon", "median s", "reps (s)", "× raw file"], rows, left=2), ""]

    fig, ax = plt.subplots(figsize=(12, 0.55 * len(wakeup) + 1.8))
    ys = list(range(len(wakeup)))[::-1]  # first entry at the top
    xmax = 0.0
    for y, w in zip(ys, wakeup):
        med = num(w.get("median_s"))
        reps = [num(s) for s in w.get("seconds") or [] if num(s) is not None]
        xmax = max([xmax] + reps + ([med] if med is not None else []))
        if med is not None:
            ax.barh(y, med, 0.65, color=colour(w.get("daemon")))
            r = ratio(med, raw.get("median_s"))
            ax.text(max(reps + [med]), y,
                    f"   {med:.3f} s" + (f" ({r:.2f}×)" if r is not None else ""),
                    va="center", fontsize=9)
        else:
            ax.text(0, y, "  n/a", va="center", fontsize=9, color="#555555")
        if reps:
            ax.plot(reps, [y] * len(reps), "k|", markersize=12)
    rawmed = num(raw.get("median_s"))
    if rawmed is not None:
        ax.axvline(rawmed, color="#555555", linestyle=":", linewidth=1)
    ax.set_yticks(ys)
    ax.set_yticklabels([w.get("target", "?") for w in wakeup])
    ax.set_ylim(-0.6, len(wakeup) - 0.4)
    ax.set_xlim(0, xmax * 1.25 if xmax else 1)
    ax.set_xlabel("seconds to read 128 MiB (median; ticks = individual reps"
                  + ("; dotted line = raw file)" if rawmed is not None else ")"))
    ax.set_title("Wake-up scenario (lower is better)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    path = os.path.join(plots_dir, "wakeup.png")
    save(fig, path, written)
    out += ["![wake-up scenario](plots/wakeup.png)", ""]
    return out


def idle_section(idle):
    out = ["## Idle cost", "",
           "CPU time (user+sys) each daemon used while serving an export with no client I/O: "
           "what polling and timers cost when there is nothing to do.", ""]
    idle = [i for i in idle or [] if isinstance(i, dict)]
    if not idle:
        return out + [NOT_MEASURED, ""]
    rows = [[i.get("daemon", NA), fmt_g(i.get("seconds")), fmt_val(i.get("cpu_ms"))]
            for i in idle]
    return out + [md_table(["daemon", "seconds", "CPU ms"], rows), ""]


# ---------------------------------------------------------------- document and README


def intro(data, docs_dir):
    machine = data.get("machine") or {}
    params = data.get("params") or {}
    command = data.get("command") or DEFAULT_COMMAND
    when = NA
    if num(data.get("unix_time")) is not None:
        when = datetime.datetime.fromtimestamp(
            num(data["unix_time"]), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = ["# Benchmarks", "",
           "<!-- Generated by scripts/bench_report.py from the run's JSON; edits are "
           "overwritten. -->", "",
           f"One run of `{command}` on {when}, which took {fmt_duration(data.get('duration_s'))}. "
           "Every figure below comes from that run; ratios compare daemons measured in the "
           "same run (alternating), so compare ratios rather than absolute numbers across runs.",
           ""]
    if params.get("quick"):
        out += ["**A quick run (`--quick`): short runs and few repetitions, for checking a "
                "change. Not for claims; the README headline was left as it was.**", ""]
    rp = data.get("results_path")
    if rp:
        link = os.path.relpath(os.path.join(REPO_ROOT, rp), docs_dir)
        out += [f"Raw data: [`{rp}`]({link}). This page, the plots in `plots/` and the README "
                "headline are regenerated from it by `scripts/bench_report.py`.", ""]
    mrows = [[k, machine[k] if machine[k] is not None else NA] for k in
             ordered(machine.keys(), ["cpus", "kernel", "reactor", "qsd", "nbdkit", "fio"])]
    prow_names = {"runtime_s": "runtime per run (s)", "ramp_ms": "ramp before each run (ms)",
                  "reps": "repetitions (medians reported)", "quick": "quick run",
                  "image_bytes": "image size"}
    prows = []
    for k in ordered(params.keys(), list(prow_names)):
        v = params[k]
        v = fmt_bytes(v) if k == "image_bytes" else (NA if v is None else v)
        prows.append([prow_names.get(k, k), v])
    if mrows:
        out += [md_table(["machine", ""], mrows, left=2), ""]
    if prows:
        out += [md_table(["parameter", ""], prows, left=2), ""]
    return out


def build_doc(data, docs_dir, plots_dir, written, history=None, density_dir=None):
    m = Matrix(data.get("matrix"))
    reps = (data.get("params") or {}).get("reps")
    lines = intro(data, docs_dir)
    lines += headline_section(m)
    exports = m.exports()
    if exports:
        for e in exports:
            lines += export_section(m, e, plots_dir, written, reps)
    else:
        lines += ["## Exports", "", NOT_MEASURED, ""]
    lines += placement_section(data.get("matrix"))
    lines += comparison_section(data, history or os.path.join(REPO_ROOT, "results", "report"))
    lines += raw_section(m)
    lines += curves_section(data.get("curves"), plots_dir, written)
    lines += window_section(data.get("window_trace"), plots_dir, written)
    lines += harvest_section(data.get("harvest"), plots_dir, written)
    lines += wakeup_section(data.get("wakeup"), plots_dir, written)
    lines += idle_section(data.get("idle"))
    lines += bench_density.section(density_dir or os.path.join(REPO_ROOT, "results", "density"),
                                   plots_dir, written, sys.modules[__name__])
    lines += ["---", "",
              "Earlier hand-run benchmarks and their analysis: "
              "[benchmark-notes.md](benchmark-notes.md)", ""]
    return "\n".join(lines)


def headline_bullets(data, readme_path, doc_path):
    m = Matrix(data.get("matrix"))
    bullets = []
    for e in m.exports():
        parts = []
        backend, case = "null", ("randread", "4k", 16)
        best = m.best_stord(e, backend, case)
        if best:
            qsd = m.get(e, backend, case, "qsd") or {}
            s = (f"{backend_label(backend)} {case_label(case)}: stord (best policy "
                 f"{policy_name(best.get('daemon'))})")
            r_iops = ratio(best.get("iops"), qsd.get("iops"))
            r_cpu = ratio(best.get("cpu_us_per_io"), qsd.get("cpu_us_per_io"))
            iv = ratio_interval(best, qsd) if qsd else None
            if r_iops is not None:
                s += f" {r_iops:.2f}× qsd's IOPS"
                if iv is not None:
                    s += f" {fmt_iv(iv)}, {verdict(iv)}"
                if r_cpu is not None:
                    s += f", at {r_cpu:.2f}× its CPU per I/O"
            else:
                s += f" {fmt_int(best.get('iops'))} IOPS"
            parts.append(s)
        backend = "file-io_uring"
        best = m.best_stord(e, backend, case)
        raw = m.raw(backend, case, e) or {}
        r_raw = ratio((best or {}).get("iops"), raw.get("iops"))
        if r_raw is not None:
            s = f"{backend_label(backend)} {case_label(case)}: {r_raw:.2f}× raw fio"
            r_q = ratio((m.get(e, backend, case, "qsd") or {}).get("iops"), raw.get("iops"))
            if r_q is not None:
                s += f" (qsd {r_q:.2f}×)"
            parts.append(s)
        if parts:
            bullets.append(f"- {export_label(e)}, " + "; ".join(parts) + ".")

    wakeup = [w for w in data.get("wakeup") or [] if isinstance(w, dict)]
    raw = wakeup_raw(wakeup)
    if wakeup:
        def name(w):
            return w.get("target") or w.get("daemon") or "?"

        def paired_qsd(w):
            """qsd's entry for the export of a stord entry (default polling preferred)."""
            if not str(w.get("daemon")).startswith("stord") or num(w.get("median_s")) is None:
                return None
            cands = [q for q in wakeup if q.get("export") == w.get("export")
                     and str(q.get("daemon")).startswith("qsd")
                     and num(q.get("median_s")) is not None]
            cands.sort(key=lambda q: q.get("daemon") != "qsd")
            return cands[0] if cands else None

        shown = set()
        pairs = [(w, paired_qsd(w)) for w in wakeup]
        for _, q in pairs:
            if q is not None:
                shown.add(id(q))
        rawmed = (raw or {}).get("median_s")
        items = []
        for w, q in pairs:
            med = num(w.get("median_s"))
            if w is raw or med is None or id(w) in shown:
                continue
            if q is None:
                r = ratio(med, rawmed)
                items.append(f"{name(w)} {med:.2f} s"
                             + (f" ({r:.2f}× raw)" if r is not None else ""))
                continue
            qmed = num(q["median_s"])
            s = f"{name(w)} {med:.2f} s vs {name(q)} {qmed:.2f} s"
            r, rq = ratio(med, rawmed), ratio(qmed, rawmed)
            if r is not None and rq is not None:
                s += f" ({r:.2f}× and {rq:.2f}× raw)"
            items.append(s)
        head = "- Wake-up scenario (128 MiB in 128 KiB O_DIRECT reads with 1 ms sleeps)"
        if raw and num(raw.get("median_s")) is not None:
            head += f": raw file {num(raw['median_s']):.2f} s"
            bullets.append(head + ("; " + ", ".join(items) if items else "") + ".")
        elif items:
            bullets.append(head + ": " + ", ".join(items) + ".")

    idle = [i for i in data.get("idle") or [] if isinstance(i, dict)]
    if idle:
        secs = {num(i.get("seconds")) for i in idle}
        if len(secs) == 1 and None not in secs:
            items = [f"{i.get('daemon')} {fmt_val(i.get('cpu_ms'))} ms"
                     if num(i.get("cpu_ms")) is not None else f"{i.get('daemon')} {NA}"
                     for i in idle]
            bullets.append(f"- Idle, CPU over {secs.pop():g} s: " + ", ".join(items) + ".")
        else:
            items = [f"{i.get('daemon')} "
                     + (f"{fmt_val(i.get('cpu_ms'))} ms"
                        if num(i.get("cpu_ms")) is not None else NA)
                     + f" over {fmt_g(i.get('seconds'))} s" for i in idle]
            bullets.append("- Idle CPU: " + ", ".join(items) + ".")

    link = os.path.relpath(doc_path, os.path.dirname(os.path.abspath(readme_path)))
    command = data.get("command") or DEFAULT_COMMAND
    bullets.append(f"- Full tables and plots: [{link}]({link}) (regenerated by `{command}`).")
    return bullets


def update_readme(readme_path, bullets):
    """Replace the lines between the markers; False (and the README untouched) if absent."""
    try:
        with open(readme_path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        print(f"warning: cannot read {readme_path}: {e}; README not updated", file=sys.stderr)
        return False
    stripped = [ln.strip() for ln in lines]
    if MARK_BEGIN not in stripped or MARK_END not in stripped[stripped.index(MARK_BEGIN):]:
        print(f"warning: {readme_path} has no '{MARK_BEGIN}' ... '{MARK_END}' markers; "
              "README not updated", file=sys.stderr)
        return False
    b = stripped.index(MARK_BEGIN)
    e = stripped.index(MARK_END, b)
    new = lines[:b + 1] + bullets + lines[e:]
    with open(readme_path, "w", encoding="utf-8") as f:
        f.write("\n".join(new))
    return True


def is_generated_plot(name):
    """File names this script writes into plots/ (and nothing else)."""
    return name in ("curves.png", "poll-window.png", "harvest.png", "wakeup.png",
                    "density.png") or (
        name.endswith(".png") and (name.startswith("iops-") or name.startswith("cpu-")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="JSON written by `stord-bench report`")
    ap.add_argument("--docs", default=os.path.join(REPO_ROOT, "docs"),
                    help="directory for benchmarks.md and plots/ (default: the repo's docs/)")
    ap.add_argument("--readme", default=os.path.join(REPO_ROOT, "README.md"),
                    help="README whose headline block to update (default: the repo's)")
    ap.add_argument("--history", default=os.path.join(REPO_ROOT, "results", "report"),
                    help="earlier runs' JSON, to compare verdicts with (default: "
                         "results/report)")
    ap.add_argument("--density", default=os.path.join(REPO_ROOT, "results", "density"),
                    help="`stord-bench density` runs for the density section (default: "
                         "results/density)")
    args = ap.parse_args()

    with open(args.results, encoding="utf-8") as f:
        data = json.load(f)
    docs_dir = os.path.abspath(args.docs)
    plots_dir = os.path.join(docs_dir, "plots")
    os.makedirs(plots_dir, exist_ok=True)

    written = []
    doc = build_doc(data, docs_dir, plots_dir, written, args.history, args.density)
    doc_path = os.path.join(docs_dir, "benchmarks.md")
    with open(doc_path, "w", encoding="utf-8") as f:
        f.write(doc)
    written.append(doc_path)

    if (data.get("params") or {}).get("quick"):
        print("quick run: README headline left as it was", file=sys.stderr)
    elif update_readme(args.readme, headline_bullets(data, args.readme, doc_path)):
        written.append(os.path.abspath(args.readme))

    for p in written:
        print(p)
    # Plots of sections this run did not measure would otherwise linger next to the new ones.
    for name in sorted(os.listdir(plots_dir)):
        path = os.path.join(plots_dir, name)
        if path not in written and is_generated_plot(name):
            os.remove(path)
            print(f"removed stale {path}")


if __name__ == "__main__":
    main()
