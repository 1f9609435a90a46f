"""The two phases every mode runs (validate every configuration, then time it), the
``Bench`` it times with, and ``run_mode``: a mode whose rows are (shape, causal, dtype)."""
import dataclasses
import sys

from numba_flash import SIMULATOR, registry

from .environment import environment, load_torch
from .harness import (CAUSAL, L2_FLUSH_BYTES, MAX_REPEATS, SEED, Bench, NumbaEvents, Shape, WallClock, input_kind,
                      make_l2_flush, select_shapes)
from .report import (Progress, _fmt, _header, print_summary, shape_point, tflops_chart, write_markdown,
                     write_outputs, wrote)
from .peers import PEERS


# --------------------------------------------------------------------------- rows (all modes)
def supported(dtype, s: Shape):
    """Whether numba_flash takes this dtype at this head dim (16-bit: d a multiple of 8, <= 256)."""
    return dtype not in registry.LOW_DTYPES or registry.VARIANTS["forward_mma"].head_dims(s.d)


def mode_configs(args):
    """Every (shape, causal, dtype) the options select, in table order; combinations the
    library does not support (a 16-bit dtype at the seed's d = 1024) are left out, said once."""
    configs, skipped = [], []
    for dt in args.dtype:
        for s in select_shapes(args):
            if not supported(dt, s):
                skipped.append(f"{s} {dt}")
                continue
            configs += [{"shape": s, "causal": c, "dtype": dt} for c in CAUSAL]
    if skipped:
        print(f"Not run (unsupported head dim for the dtype): {', '.join(skipped)}", flush=True)
    return configs


def new_record(mode, cfg, flops, val):
    return {"mode": mode, "shape": dataclasses.asdict(cfg["shape"]), "causal": cfg["causal"],
            "dtype": cfg["dtype"], "flops": flops, "valid": val["valid"], "validation": val,
            "ours": {}, "peers": {}}


def row_label(cfg):
    if "label" in cfg:                   # modes whose rows are not (shape, causal, dtype)
        return cfg["label"]
    return f"{cfg['shape']} {'causal' if cfg['causal'] else 'full'} {cfg['dtype']}"


def progress_label(cfg):
    """What the progress line says of a configuration: dtype, then shape (or the row's label)."""
    if "label" in cfg:
        return f"{cfg.get('dtype', 'float32')} {cfg['label']}"
    return f"{cfg['dtype']} {cfg['shape']} {'causal' if cfg['causal'] else 'full'}"


def validate_all(configs, bench, validate_one, progress=None):
    """Phase 1: every configuration against the oracle.

    ``validate_one(cfg, bench)`` returns ``(validation record, context for time_one)``; the
    record has ``valid``, ``error`` (and ``traceback``), ``max_abs_err`` and ``summary``.
    ``progress``: a ``report.Progress`` told of each step, or None.
    """
    print(f"Validating {len(configs)} configurations against numba_flash.reference (float64, CPU) ...",
          flush=True)
    results = []
    for cfg in configs:
        if progress:
            progress.step(f"validate {progress_label(cfg)}")
        val, ctx = validate_one(cfg, bench)
        if progress:
            progress.clear()
        results.append((val, ctx))
        if val["valid"]:
            print(f"  ok       {row_label(cfg)}: {val['summary']}", flush=True)
        else:
            what = val["error"] or val["summary"]
            print(f"  INVALID  {row_label(cfg)}: {what}", flush=True)
            print(f"VALIDATION FAILED for {row_label(cfg)}: {what}\n{val.get('traceback', '')}",
                  file=sys.stderr, flush=True)
    return results


def time_all(configs, validated, bench, time_one, progress=None):
    """Phase 2: ``time_one(cfg, val, ctx, bench)`` (-> row record) for each configuration."""
    print(f"Timing {len(configs)} configurations ({bench.events.name}; median of >= {bench.repeats} "
          f"repeats and >= {bench.min_time_s:g} s; peers: {', '.join(bench.peers) or 'none'}) ...", flush=True)
    rows = []
    try:
        for cfg, (val, ctx) in zip(configs, validated):
            if progress:
                progress.step(f"time {progress_label(cfg)}")
            rec = time_one(cfg, val, ctx, bench)
            if progress:
                progress.clear()
            print(f"  {row_label(cfg)}: {_brief(rec)}", flush=True)
            rows.append(rec)
    except KeyboardInterrupt:
        interrupted(rows, len(configs))
    return rows


def interrupted(rows, total):
    """After Ctrl-C or SIGTERM in a row loop: say so (the document then says
    ``"interrupted": true``: :func:`run_doc`)."""
    print(f"\nInterrupted after {len(rows)} of {total} rows: writing those.", file=sys.stderr, flush=True)


def run_doc(mode, env, settings, rows, total):
    """A mode's JSON document; ``interrupted`` when it has fewer rows than ``total``."""
    doc = {"mode": mode, **env, "settings": settings, "rows": rows}
    if len(rows) < total:
        doc["interrupted"] = True
    return doc


def _brief(rec):
    parts = [f"ours {_fmt(rec['ours'].get('ms_median'), '.3f')} ms "
             f"{_fmt(rec['ours'].get('tflops'), '.2f')} TFLOP/s"]
    for name, p in rec["peers"].items():
        why = f" ({p['error']})" if p.get("error") else ""
        parts.append(f"{PEERS[name][0]} {_fmt(p.get('tflops'), '.2f')}{why}")
    return "; ".join(parts)


def make_bench(args):
    """Timers, repeat policy, L2 flush and torch (TF32 off: a true float32 MATH peer)."""
    torch = load_torch()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
    peers = () if torch is None or args.no_peers else tuple(PEERS)
    return Bench(events=WallClock() if SIMULATOR else NumbaEvents(),
                 repeats=args.repeats, min_time_s=args.min_time, warmup=args.warmup,
                 flush=None if args.no_flush_l2 else make_l2_flush(), torch=torch,
                 kind=input_kind(torch), peers=peers)


def run_mode(args, mode, validate_one, time_one, columns, notes, settings):
    """Validate, time, write JSON (and Markdown), print the table last; returns the exit status.

    ``notes(doc)`` -> lines under the table; ``settings``: the mode's entries of the JSON
    ``settings`` (tolerance, what is validated, FLOP convention, timed call).
    """
    bench = make_bench(args)
    env = environment(bench.torch)
    print(_header(env), flush=True)
    configs = mode_configs(args)
    progress = Progress(mode, 2 * len(configs))
    validated = validate_all(configs, bench, validate_one, progress)
    rows = time_all(configs, validated, bench, time_one, progress)
    progress.close()
    doc = run_doc(mode, env, {**_settings(args, bench), **settings}, rows, len(configs))
    written = write_outputs(args, doc, lambda d, path: tflops_chart(d, path, shape_point))
    if args.markdown:
        write_markdown(args.markdown, doc, columns, notes(doc))
        written.append(args.markdown)
    print(wrote(written))
    return print_summary(rows, columns, notes(doc))


def finish_rows(args, bench, env, mode, rows, progress, point, total):
    """The end of a mode whose rows are not (shape, causal, dtype) (variants, serving): the
    progress line closed, the document (of ``total`` rows asked for), its JSON, CSV and plot
    (``point``: ``tflops_chart``'s)."""
    progress.close()
    doc = run_doc(mode, env, _settings(args, bench), rows, total)
    return doc, write_outputs(args, doc, lambda d, path: tflops_chart(d, path, point))


def _settings(args, bench):
    return {"repeats_min": bench.repeats, "min_time_s": bench.min_time_s, "warmup": bench.warmup,
            "max_repeats": MAX_REPEATS, "l2_flush_bytes": 0 if bench.flush is None else L2_FLUSH_BYTES,
            "timer": bench.events.name, "inputs": bench.kind, "peers": {n: PEERS[n][1] for n in bench.peers},
            "seed": SEED, "argv": args.argv}


