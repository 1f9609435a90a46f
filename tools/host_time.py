"""Where a call's host time goes (a GPU machine with PyTorch)::

    python tools/host_time.py                                   # every row below
    python tools/host_time.py --rows varlen,decode_gqa --calls 300 --top 25 --json host.json

Per row, on PyTorch CUDA tensors (bf16): the host's time until a synchronised call
returns (median), the same call's CUDA-event time (what ``bench.py`` reports: from an
event recorded before the call to one after it), its time at the GPU's pace
(``benchmarks/gpu_pace.py``: calls queued behind a GPU sleep) and their difference, the
host's part of the event time: what the GPU waits for before the kernels start. Then a
cProfile of ``--calls`` synchronised calls, the functions with the most time of their own
and the most time under them. docs/performance.md item 73 did this by hand for the
serving rows; the rows here are bench.py's: the forward's (4,16,4096,128) and the serving
mode's bfloat16 rows, their inputs made by ``benchmarks.modes.serving.serving_inputs``.
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, numba_flash/ from this tree

# row name -> bench.py serving's row label (its bfloat16 row)
SERVING = {"varlen": "varlen", "padded": "padded", "decode": "decode", "decode_gqa": "decode gqa",
           "kvcache": "kvcache", "kvcache_gqa": "kvcache gqa"}


def _rows(rand):
    """Row name -> a function that makes the inputs and returns the call (bench.py's)."""
    import numba_flash
    from benchmarks.modes.serving import SERVING_ROWS, serving_inputs
    serving = {r.label: r for r in SERVING_ROWS if r.dtype == "bfloat16"}

    def attention(causal):
        q, k, v = (rand(4, 16, 4096, 128) for _ in range(3))
        return lambda: numba_flash.attention(q, k, v, causal=causal)

    def served(label):
        import torch
        return serving_inputs(serving[label], types.SimpleNamespace(kind="torch", torch=torch))[0]

    rows = {"forward": lambda: attention(False), "causal": lambda: attention(True)}
    rows.update({name: (lambda label=label: served(label)) for name, label in SERVING.items()})
    return rows


ROWS = ("forward", "causal", "varlen", "padded", "decode", "decode_gqa", "kvcache", "kvcache_gqa")


def parse_rows(text):
    """Comma-separated row names, checked against :data:`ROWS` (empty: all)."""
    names = [x.strip() for x in text.split(",") if x.strip()] or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise ValueError(f"--rows: unknown {', '.join(map(repr, unknown))}; the rows are {', '.join(ROWS)}")
    return names


def _profile(call, calls, top, torch):
    """The cProfile of ``calls`` synchronised calls: the ``top`` functions by their own time
    and by time under them, as pstats prints them."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        call()
        torch.cuda.synchronize()
    prof.disable()
    text = []
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        text.append(out.getvalue())
    return text


def measure(call, torch, calls, top):
    """One row's record: host ms, event ms, GPU-pace ms, the host's part, the profiles."""
    from benchmarks.gpu_pace import gpu_pace_ms
    for _ in range(5):
        call()
    host, event = [], []
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    for _ in range(calls):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        call()
        host.append(1e3 * (time.perf_counter() - t0))
        end.record()
        end.synchronize()
        event.append(start.elapsed_time(end))
    pace = gpu_pace_ms(call, torch)
    rec = {"host_ms": statistics.median(host), "event_ms": statistics.median(event), "gpu_pace_ms": pace}
    rec["host_part_ms"] = rec["event_ms"] - pace
    rec["profile_by_own_time"], rec["profile_by_time_under"] = _profile(call, calls, top, torch)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="", help=f"comma-separated, from {', '.join(ROWS)} (default: all)")
    p.add_argument("--calls", type=int, default=200, help="synchronised calls timed, and profiled (default 200)")
    p.add_argument("--top", type=int, default=20, help="functions listed per profile (default 20)")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    names = parse_rows(args.rows)
    import torch
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    makers, records = _rows(rand), {}
    for name in names:
        rec = records[name] = measure(makers[name](), torch, args.calls, args.top)
        print(f"##### {name}: host {rec['host_ms']:.4f} ms a call; event {rec['event_ms']:.4f}, GPU pace "
              f"{rec['gpu_pace_ms']:.4f}: the host's part {rec['host_part_ms']:.4f} ms", flush=True)
        print(rec["profile_by_own_time"][:6000] + rec["profile_by_time_under"][:8000], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print("\n".join(f"{n:>12}: host {r['host_ms']:.4f} ms, event {r['event_ms']:.4f}, GPU pace "
                    f"{r['gpu_pace_ms']:.4f}, host's part {r['host_part_ms']:.4f}" for n, r in records.items()))


if __name__ == "__main__":
    main()
