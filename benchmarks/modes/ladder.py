"""``bench.py ladder``: the kernel ladder (``numba_flash.ladder``), rung by rung, on the seed problem."""
import traceback
from pathlib import Path

import numpy as np

from numba_flash import SIMULATOR, reference

from numba import cuda  # noqa: E402  (after numba_flash)

from ..environment import environment
from ..harness import SEED, max_abs_err, time_numba, to_host
from ..report import (Progress, _fmt, _header, print_summary, pyplot, simulator_notes, write_markdown,
                      write_outputs, wrote)
from ..runner import _settings, make_bench, run_doc, time_all, validate_all


# --------------------------------------------------------------------------- ladder
LADDER_SHAPE = (1024, 1024)        # the seed's problem: N, d (one head, no mask)
LADDER_TINY_SHAPE = (12, 12)       # --tiny: a smoke test in the simulator
LADDER_TOLERANCE = 1e-4            # the seed's pass/fail: max abs error vs the (float64) reference


def ladder_configs(args):
    from numba_flash import ladder
    n, d = LADDER_TINY_SHAPE if args.tiny else (args.n, args.d)
    keep = None if args.rungs is None else set(args.rungs)
    configs = [{"rung": r, "n": n, "d": d, "label": f"rung {r.number} {r.name}"}
               for r in ladder.RUNGS if keep is None or r.number in keep]
    if not configs:
        raise SystemExit(f"bench.py ladder: no rung in --rungs {args.rungs}; the rungs are "
                         + ", ".join(str(r.number) for r in ladder.RUNGS))
    return configs


def ladder_arrays(cfg):
    """The seed's inputs on the device (NumPy in the simulator), and on the host."""
    from numba_flash import ladder
    host = ladder.seed_inputs(cfg["n"], cfg["d"], SEED)
    return (host if SIMULATOR else tuple(cuda.to_device(a) for a in host)), host


def validate_ladder_config(cfg, bench):
    """One call of the rung on the timed inputs, every element against the float64 oracle."""
    rung = cfg["rung"]
    val = {"tolerance": LADDER_TOLERANCE, "error": None, "max_abs_err": None}
    try:
        arrays, host = ladder_arrays(cfg)
        ref = reference.attention(*host)
        err = max_abs_err(to_host(rung(*arrays)), ref)
    except Exception as exc:  # noqa: BLE001 - reported, row marked invalid
        val.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(), valid=False)
        return val, None
    val.update(max_abs_err=err, valid=bool(err <= LADDER_TOLERANCE),
               summary=f"max abs err {err:.2e} (tol {LADDER_TOLERANCE:.0e})")
    return val, None


def time_ladder_row(cfg, val, ctx, bench):
    rung, n, d = cfg["rung"], cfg["n"], cfg["d"]
    flops = 4.0 * n * n * d
    val.pop("summary", None)
    rec = {"mode": "ladder", "rung": rung.number, "name": rung.name, "title": rung.title,
           "change": rung.change, "n": n, "d": d, "flops": flops, "valid": val["valid"], "validation": val,
           "seed_h200_ms": rung.seed_h200_ms, "ours": {}, "peers": {}}
    if val["valid"]:
        arrays, _ = ladder_arrays(cfg)
        rec["ours"] = time_numba(lambda: rung(*arrays), bench, flops)
    else:
        rec["ours"]["error"] = "not timed: validation failed"
    return rec


def add_speedups(rows):
    """``vs_previous``: previous rung's time ÷ this rung's (> 1: faster); ``vs_first``: rung 1's."""
    prev = first = None
    for r in rows:
        ms = r["ours"].get("ms_median")
        r["vs_previous"] = prev / ms if prev and ms else None
        r["vs_first"] = first / ms if first and ms else None
        prev = ms
        first = first or ms


def ladder_chart(doc, path):
    """A bar chart of the rungs' times (ours and the seed's C++ on an H200); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = doc["rows"]
    x = np.arange(len(rows))
    ours = [r["ours"].get("ms_median") or np.nan for r in rows]
    seed = [r["seed_h200_ms"] or np.nan for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, ours, 0.4, label=f"numba_flash ladder ({doc['gpu']['name']})")
    ax.bar(x + 0.2, seed, 0.4, label="seed's C++ kernels (H200)", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{r['rung']}\n{r['title'][:22]}" for r in rows], fontsize=7)
    ax.set_ylabel("ms (log scale)")
    n, d = rows[0]["n"], rows[0]["d"]
    ax.set_title(f"Kernel ladder: attention forward, N = {n}, d = {d}, float32")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _ladder_pass(r):
    e = r["validation"].get("max_abs_err")
    if r["validation"].get("error"):
        return "error"
    return "pass" if e is not None and e <= LADDER_TOLERANCE else "FAIL"


LADDER_COLUMNS = [
    ("rung", 4, lambda r: str(r["rung"])),
    ("change", 42, lambda r: r["title"][:42]),
    ("ms", 9, lambda r: _fmt(r["ours"].get("ms_median"), ".3f")),
    ("× prev", 7, lambda r: _fmt(r.get("vs_previous"), ".2f")),
    ("TFLOP/s", 8, lambda r: _fmt(r["ours"].get("tflops"), ".3f")),
    ("max err", 8, lambda r: _fmt(r["validation"].get("max_abs_err"), ".1e")),
    ("1e-4", 5, _ladder_pass),
    ("seed C++ H200 ms", 16, lambda r: _fmt(r["seed_h200_ms"], ".2f")),
]


def ladder_notes(doc):
    s = doc["settings"]
    return [
        f"Times: median over >= {s['repeats_min']} repeats and >= {s['min_time_s']:g} s ({s['timer']}); each repeat "
        "is one call rung(q, k, v) on device arrays (Python dispatch and the output allocation INCLUDED, no host "
        "copies)" + (", L2 flushed before it" if s["l2_flush_bytes"] else "") + ".",
        f"× prev: previous rung's ms / this rung's. TFLOP/s: 4·N²·d, the useful work (rungs 1-8 recompute "
        "Q·Kᵀ once per block column of O, so they execute more). max err: max |out - float64 oracle| over "
        f"all N·d elements; 1e-4: the seed's pass/fail (tolerance {LADDER_TOLERANCE:.0e}).",
        "seed C++ H200 ms: the seed article's C++ kernels, measured on an H200 (its rung 8 is fp16 WMMA and "
        "fails 1e-4): the targets.",
    ] + simulator_notes(doc)


def run_ladder(args):
    """python bench.py ladder: the seed's Results table, rung by rung, on this GPU."""
    bench = make_bench(args)
    env = environment(bench.torch)
    env["inputs"] = "numpy" if SIMULATOR else "numba"
    print(_header(env), flush=True)
    configs = ladder_configs(args)
    progress = Progress("ladder", 2 * len(configs))
    validated = validate_all(configs, bench, validate_ladder_config, progress)
    rows = time_all(configs, validated, bench, time_ladder_row, progress)
    progress.close()
    add_speedups(rows)
    n, d = configs[0]["n"], configs[0]["d"]
    settings = {**_settings(args, bench), "peers": {}, "problem": {"N": n, "d": d, "dtype": "float32"},
                "inputs_distribution": "(r mod 5) + 0.01 (r' mod 5), random sign (the seed's)",
                "tolerance": LADDER_TOLERANCE, "flop_convention": "4*N*N*d",
                "timed_call": "numba_flash.ladder rung(q, k, v), device arrays in and out"}
    doc = run_doc("ladder", env, settings, rows, len(configs))
    written = write_outputs(args, doc)           # --plot: the bar chart below, at that path
    png = args.plot or args.png or str(Path(args.json).with_suffix(".png"))
    if ladder_chart(doc, png):
        written.append(png)
    if args.markdown:
        write_markdown(args.markdown, doc, LADDER_COLUMNS, ladder_notes(doc))
        written.append(args.markdown)
    print(wrote(written) + ("" if png in written else " (no chart: matplotlib is not importable)"))
    return print_summary(rows, LADDER_COLUMNS, ladder_notes(doc))


def ladder_options(p):
    p.add_argument("--n", type=int, default=LADDER_SHAPE[0], help=f"sequence length N (default {LADDER_SHAPE[0]})")
    p.add_argument("--d", type=int, default=LADDER_SHAPE[1], help=f"head dim d (default {LADDER_SHAPE[1]})")
    p.add_argument("--rungs", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="comma-separated rung numbers (default: all)")
    p.add_argument("--png", default=None, help="bar chart path (default: the JSON path with .png; --plot "
                   "names it too)")


