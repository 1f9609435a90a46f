"""What a run writes: the fixed-width table, JSON, Markdown, CSV, the TFLOP/s plot, and the
progress line."""
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .harness import Shape
from .peers import PEERS


def print_summary(rows, columns, notes):
    """The table and its notes, printed last so they end the log; returns the exit status."""
    print()
    print(render_table(rows, columns))
    for line in notes:
        print(line)
    invalid = [r for r in rows if not r["valid"]]
    if invalid:
        print(f"VALIDATION FAILED for {len(invalid)} of {len(rows)} rows (marked INVALID, not timed).")
        return 1
    return 0


def _header(env):
    v = env["versions"]
    return (f"numba_flash bench · {env['date']} · {env['gpu']['name']} · git {(env['git_sha'] or '?')[:12]}"
            f"{' (dirty)' if env['git_dirty'] else ''} · numba {v['numba']}, numba-cuda {v['numba-cuda']}, "
            f"torch {v['torch'] or '—'} · inputs: {env['inputs']}")


def common_notes(doc, call, flops):
    """Timing and peer notes shared by the modes; ``call``: what one repeat runs."""
    s = doc["settings"]
    return [
        f"Times: median over >= {s['repeats_min']} repeats and >= {s['min_time_s']:g} s ({s['timer']}); each "
        f"repeat is {call}, synchronised before"
        + (", L2 flushed" if s["l2_flush_bytes"] else "") + ", so Python dispatch overhead is INCLUDED "
        "(JSON: host_ms_median).",
        f"TFLOP/s: FlashAttention convention, {flops}. ratio = ours TFLOP/s ÷ peer "
        "TFLOP/s (> 1: ours faster). Peers: torch SDPA "
        + (", ".join(f"{PEERS[n][0]} = {b}" for n, b in s["peers"].items()) or "not run")
        + ", same tensors; '—' = unsupported, out of memory or not run.",
        "kernel ms: the same call's kernel launches alone, prepared once (api.plan_forward / plan_backward: "
        "input checks, output allocation and views excluded; Numba's per-launch argument handling included). "
        "ours ms − kernel ms is the host time the call adds. op ms: the same call through "
        "numba_flash.torch's custom op (PyTorch inputs only); op ms − ours ms is what the op adds.",
    ]


def simulator_notes(doc):
    return ["SIMULATOR: no GPU, timings are meaningless (validation only)."] if doc["simulator"] else []


# --------------------------------------------------------------------------- reporting
def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _peer(name, key, spec):
    def get(r):
        p = r["peers"].get(name) or {}
        return _fmt(p.get(key), spec) + ("x" if key == "ratio" and p.get(key) is not None else "")
    return get


def _err(r):
    v = r["validation"]
    if v.get("error"):
        return "error"
    return _fmt(v.get("max_abs_err"), ".1e")


def make_columns(theory_header, theory_key):
    """(header, width, row -> text) table columns; peer columns are generated from PEERS.
    ``theory_key``: the ``ours`` entry with the theoretical memory shown next to the measured."""
    return (
        [("shape (B,H,N,d)", 18, lambda r: str(Shape(**r["shape"]))),
         ("causal", 6, lambda r: "yes" if r["causal"] else "no"),
         ("dtype", 7, lambda r: r["dtype"]),
         ("ours ms", 9, lambda r: _fmt(r["ours"].get("ms_median"), ".3f")),
         ("ours TF/s", 9, lambda r: _fmt(r["ours"].get("tflops"), ".2f")),
         ("kernel ms", 9, lambda r: _fmt(r["ours"].get("kernel_ms_median"), ".3f")),
         ("op ms", 9, lambda r: _fmt(r["ours"].get("op_ms_median"), ".3f"))]
        + [(f"{lbl} TF/s", 9, _peer(n, "tflops", ".2f")) for n, (lbl, _) in PEERS.items()]
        + [(f"ours/{lbl}", 9, _peer(n, "ratio", ".2f")) for n, (lbl, _) in PEERS.items()]
        + [("extra MiB", 9, lambda r: _fmt(r["ours"].get("extra_mib"), ".1f")),
           (theory_header, max(9, len(theory_header)), lambda r: _fmt(r["ours"].get(theory_key), ".1f")),
           ("max err", 8, _err),
           ("valid", 7, lambda r: "ok" if r["valid"] else "INVALID")]
    )




def render_table(rows, columns):
    head = "  ".join(h.rjust(w) for h, w, _ in columns)
    lines = [head, "-" * len(head)]
    lines += ["  ".join(get(r).rjust(w) for _, w, get in columns) for r in rows]
    return "\n".join(lines)


def render_markdown(doc, columns, notes):
    env = doc
    v = env["versions"]
    sha = (env["git_sha"] or "unknown")[:12] + (" (dirty)" if env.get("git_dirty") else "")
    lines = [f"**{doc['mode']}** · {env['date']} · {env['gpu']['name']} "
             f"(driver {env['gpu'].get('driver') or '?'}, CUDA {env['gpu'].get('cuda_runtime') or '?'}) · "
             f"git `{sha}` · numba {v['numba']}, numba-cuda {v['numba-cuda']}, torch {v['torch'] or '—'}",
             "",
             "| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---:" for _ in columns) + "|"]
    lines += ["| " + " | ".join(get(r) for _, _, get in columns) + " |" for r in doc["rows"]]
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_json(path, doc):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def write_markdown(path, doc, columns, notes):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(doc, columns, notes))




# --------------------------------------------------------------------------- CSV
def flatten(rec, prefix=""):
    """One JSON row as flat ``{dotted key: value}``: nested records give ``ours.ms_median``,
    ``peers.sdpa_flash.tflops``, ...; lists (launches, grids) stay JSON text."""
    flat = {}
    for key, value in rec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, default=_json_default)
        else:
            flat[name] = value
    return flat


def write_csv(path, rows):
    """One line per row of the JSON (``flatten``); the header is every key any row has, in
    the order first met."""
    import csv
    flat = [flatten(r) for r in rows]
    fields = list(dict.fromkeys(k for f in flat for k in f))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        out = csv.DictWriter(fh, fieldnames=fields, extrasaction="raise")
        out.writeheader()
        out.writerows({k: _json_default(v) if isinstance(v, np.generic) else v for k, v in f.items()} for f in flat)


# --------------------------------------------------------------------------- plot
PLOT_NEEDS = "--plot needs matplotlib, which is not installed here (pip install matplotlib)"


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def tflops_chart(doc, path, point):
    """TFLOP/s against sequence length, one panel per (dtype, causal, head dim), numba_flash and
    each peer a line. ``point(row)`` -> ``(dtype, causal, d, N, {series: TFLOP/s or None})``."""
    plt = pyplot()
    if plt is None:
        raise SystemExit(PLOT_NEEDS)
    panels = {}
    for rec in doc["rows"]:
        dtype, causal, d, n, series = point(rec)
        for name, tf in series.items():
            if tf:
                panels.setdefault((dtype, causal, d), {}).setdefault(name, []).append((n, tf))
    keys = sorted(panels, key=lambda k: (k[0], k[1], k[2])) or [None]
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        if key is None:
            ax.text(0.5, 0.5, "no timed rows", ha="center", va="center", transform=ax.transAxes)
            continue
        for name, pts in panels[key].items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        dtype, causal, d = key
        ax.set_title(f"{dtype}, {'causal' if causal else 'full'}, d = {d}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    sha = (doc.get("git_sha") or "?")[:7]
    fig.suptitle(f"bench.py {doc['mode']} · {doc['gpu']['name']} · {doc['date'][:10]} · {sha}"
                 + (" · SIMULATOR: times mean nothing" if doc.get("simulator") else ""), fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shape_point(rec):
    """``tflops_chart``'s point of a (shape, causal, dtype) row: ours and each SDPA peer."""
    s = rec["shape"]
    series = {"numba_flash": rec["ours"].get("tflops")}
    series.update({f"sdpa {PEERS[name][0]}": p.get("tflops") for name, p in rec["peers"].items()})
    return rec["dtype"], rec["causal"], s["d"], s["Nq"], series


def labelled_series(rec):
    """A variants or serving row's series for ``tflops_chart``: ours and each peer, named with the
    row's label (each label a line of its own)."""
    label = rec["row"]["label"]
    series = {f"numba_flash {label}": rec["ours"].get("tflops")}
    series.update({f"{name} {label}": p.get("tflops") for name, p in rec["peers"].items()})
    return series


# --------------------------------------------------------------------------- all files of a run
def write_outputs(args, doc, chart=None):
    """The JSON, and the CSV (``--csv``) and plot (``--plot``; ``chart(doc, path)``) when asked
    for; returns the paths written."""
    write_json(args.json, doc)
    written = [args.json]
    if getattr(args, "csv", None):
        write_csv(args.csv, doc["rows"])
        written.append(args.csv)
    if getattr(args, "plot", None) and chart is not None:
        chart(doc, args.plot)
        written.append(args.plot)
    return written


def wrote(paths):
    """"Wrote a, b and c"."""
    paths = [str(x) for x in paths]
    return "Wrote " + (", ".join(paths[:-1]) + " and " if len(paths) > 1 else "") + paths[-1]


# --------------------------------------------------------------------------- progress
class Progress:
    """``[i/n] mode ...`` on stderr while a run goes on: overwritten in place (``\\r``) on a
    terminal, one plain line per step otherwise. Nothing shows until the run has taken
    ``delay_s`` (a short run stays quiet); a step still running then is shown at once."""

    def __init__(self, mode, total, stream=None, delay_s=3.0):
        import threading
        self.mode, self.total = mode, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.delay_s = delay_s
        self.done = 0             # steps begun
        self.line = None          # the step now running
        self.shown = False        # a line is on the terminal (tty) / lines are being written
        self.lock = threading.Lock()
        self.timer = threading.Timer(delay_s, self._late)
        self.timer.daemon = True
        self.timer.start()

    def step(self, text):
        """The next step begins: ``text`` says what it is (dtype, shape, ...)."""
        with self.lock:
            self.done += 1
            self.line = f"[{self.done}/{self.total}] {self.mode} {text}"
            if self.shown or time.monotonic() - self.t0 >= self.delay_s:
                self._write()

    def clear(self):
        """The step is done (its result is about to be printed): take its line away."""
        with self.lock:
            if self.tty and self.line is not None and self.shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self.line = None

    def close(self):
        self.timer.cancel()
        self.clear()

    def _late(self):
        with self.lock:
            if self.line is not None:
                self._write()

    def _write(self):
        self.shown = True
        if self.tty:
            width = shutil.get_terminal_size((120, 20)).columns - 1
            self.stream.write("\r\x1b[K" + self.line[:width])
        else:
            self.stream.write(self.line + "\n")
        self.stream.flush()
