"""Where the Hopper forward's time goes, item by item (a compute capability 9.0 GPU with
PyTorch)::

    python tools/trace_items.py --shapes "1,16,16384,128,1,w=1024;4,16,4096,64,0;16,8,1024,256,1"
    python tools/trace_items.py --varlen --json trace.json
    python tools/trace_items.py --varlen --by-tiles     # short items' phases apart from long ones'

Per call (``B,H,N,d,causal[,w=L][,c=C][,t]`` as ``tools/ab.py`` takes them; ``--varlen``: the
causal batch of ``bench.py serving``): the plan's Hopper forward kernel rebuilt with
``forward_wgmma.make_forward_wgmma``'s ``trace`` (the item overlap off: compare the plain
kernel's time with the item overlap off too, which this prints), launched once untimed and
once traced. Each block stamps its items' phases with the multiprocessor's cycle counter
(``forward_wgmma.TRACE_PHASES``): per consumer warpgroup the item's start, Q landed, the
first key tile's K landed and its softmax done, the later tiles done, the last P V and the
rows' sums done, O stored; the producer's Q load issued and its last V load issued.
Printed, as medians over the items (cycles, and in the loop's key tiles' worth: a phase's
cycles over the median cycles a later key tile takes): placing the item (the schedule's
item, its rows and score constants, from the item's start), the wait for Q, the wait for K_0
after it, the first tile (from K_0 landed), a later tile, the last tile, the store, the
gap to the block's next item, and an item's fixed cost (its cycles less its key tiles at
the loop's pace); per block its busy cycles (first start to last store), their spread, and
the cycles the GPU's last block ran past the mean. (Before 2026-12-06 "first" ran from Q
landed: docs/performance.md item 121's table.)

The traced kernels keep their key-tile loops (no spill there) but may spill a little at
item boundaries (ptxas, bf16: the window kernel at d = 64 120/144 bytes): the per-item
phases are upper bounds. docs/performance.md item 117.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from ab import parse_lens, parse_shapes, set_constants, shape_inputs  # noqa: E402  (beside this file)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


# Items grouped by their key tiles (``by_tiles``): the upper bounds of the groups
TILE_GROUPS = (2, 4, 8, 16, 32)


def tile_group(tiles):
    """The :data:`TILE_GROUPS` label of an item of ``tiles`` key tiles: "1-2", "3-4", ..., "33+"."""
    low = 1
    for high in TILE_GROUPS:
        if tiles <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def summarise(stamps, nwg):
    """The phases of every item of a ``(blocks, items, TRACE_EVENTS)`` stamp array: medians in
    cycles and in later key tiles' worth, and the blocks' busy cycles; ``by_tiles``: the
    same medians (and the items' count) for the items of each :func:`tile_group`, whose
    fixed costs say whether short items (a varlen batch's short sequences) pay more than
    long ones."""
    from numba_flash.kernels.forward_wgmma import TRACE_K0, TRACE_PLACED, TRACE_PRODUCER, TRACE_TILES
    phases = {n: [] for n in ("place", "wait_q", "wait_k0", "first", "tile", "last", "store", "gap", "item",
                              "fixed_tiles", "q_lead")}
    busy = []
    items = []
    groups = {}         # tile group -> [(phase, value)] of its items
    for blk in stamps:
        starts, ends = [], []
        rows = [r for r in blk if r[0] > 0]        # the items the block took (warpgroup 0 started them)
        for n, r in enumerate(rows):
            tiles = int(r[TRACE_TILES])
            for w in range(nwg):
                start, q, first, loop, last, stored = (int(x) for x in r[6 * w:6 * w + 6])
                starts.append(start)
                ends.append(stored)
                if tiles == 0:
                    continue
                items.append((tiles, stored - start))
                k0, placed = int(r[TRACE_K0 + w]), int(r[TRACE_PLACED + w])
                seen = [("place", placed - start), ("wait_q", q - placed), ("wait_k0", k0 - q),
                        ("first", first - k0), ("last", last - loop), ("store", stored - last),
                        ("item", stored - start)]
                if tiles > 1:
                    seen.append(("tile", (loop - first) / (tiles - 1)))
                if n + 1 < len(rows):
                    seen.append(("gap", int(rows[n + 1][6 * w]) - stored))
                for key, value in seen:
                    phases[key].append(value)
                groups.setdefault(tile_group(tiles), []).extend(seen + [("tiles", tiles)])
                if w == 0 and r[TRACE_PRODUCER] > 0:
                    phases["q_lead"].append(q - int(r[TRACE_PRODUCER]))
        if starts:
            busy.append(max(ends) - min(starts))
    tile = _median(phases["tile"])
    phases["fixed_tiles"] = [(cycles - tiles * tile) / tile for tiles, cycles in items] if tile == tile else []
    out = {n: _median(v) for n, v in phases.items()}
    out["items"] = len(items)
    out["busy_mean"] = statistics.fmean(busy) if busy else float("nan")
    out["busy_max"] = max(busy) if busy else float("nan")
    out["by_tiles"] = {}
    for label, seen in sorted(groups.items(), key=lambda g: int(g[0].split("-")[0].rstrip("+"))):
        by = {}
        for key, value in seen:
            by.setdefault(key, []).append(value)
        g = {key: _median(values) for key, values in by.items() if key != "tiles"}
        g["items"] = len(by["tiles"])
        g["fixed_tiles"] = (_median([c - t * tile for t, c in zip(by["tiles"], by["item"])]) / tile
                            if tile == tile else float("nan"))
        out["by_tiles"][label] = g
    return out


def by_tiles_lines(summary):
    """The table of a :func:`summarise` summary's ``by_tiles``: a line per group of items
    (their key tiles, how many, the phases' median cycles, the fixed cost in tiles)."""
    keys = ("place", "wait_q", "wait_k0", "first", "last", "store", "gap")
    lines = [f"   by key tiles {'items':>6s} " + " ".join(f"{k:>8s}" for k in keys) + "  fixed (tiles)"]
    for label, g in summary["by_tiles"].items():
        lines.append(f"   {label:>12s} {g['items']:6d} " + " ".join(f"{g.get(k, float('nan')):8.0f}" for k in keys)
                     + f"  {g['fixed_tiles']:13.2f}")
    return lines


def trace_call(launches, rows, heads, repeats=5):
    """Run a call's launches (``(kernel, grid, block, shared bytes, args, stream)`` each, the
    Hopper forward last) with the forward traced: ``(stamp array, consumer warpgroups, ms of
    the plain forward with the item overlap off, ms traced)``; ``rows``: the query rows of
    each sequence, ``heads``: the leading indices (batch times heads, or a packed call's
    heads), which give the work items."""
    import numpy as np
    from numba import cuda
    from numba_flash import _kernel_cache, registry
    from numba_flash.kernels import forward_wgmma
    from numba_flash.kernels.wgmma_parts import padded
    from numba_flash.launch import launch
    kern, grid, threads, smem, args, stream = launches[-1]
    spec = _kernel_cache.kernel_identity(kern)
    if not isinstance(spec, registry.Specialisation) or spec.variant != "forward_wgmma":
        raise SystemExit(f"the call's forward is not the Hopper family's ({_kernel_cache.kernel_name(kern)}): run "
                         "on a compute capability 9.0 GPU, bfloat16 or float16, a head dim it takes")
    common = dict(bn=spec.tiling.BN, bm=spec.tiling.BM, fixed_max=forward_wgmma.FIXED_MAX_SOFTCAP)
    if spec.scores.packed and padded(spec.d) == 64:
        # traced with the published items, this kernel's products serialise (ptxas 13): both
        # kernels here without them (tests/test_ptx.py::test_traced_hopper_forward_compiles)
        common["publish"] = False
    plain = forward_wgmma.make_forward_wgmma(spec.dtype, spec.d, spec.scores, overlap=False, **common)
    traced = forward_wgmma.make_forward_wgmma(spec.dtype, spec.d, spec.scores, trace=True, **common)
    for a in launches[:-1]:
        launch(*a)
    items = heads * sum(-(-r // spec.tiling.BM) for r in rows)
    per_block = max(1, -(-items // grid))
    trace = cuda.to_device(np.zeros((grid, per_block, forward_wgmma.TRACE_EVENTS), np.int64))
    ms = {}
    on = stream if hasattr(stream, "handle") else 0     # (a Numba stream, else the default stream)
    for name, k, extra in (("plain", plain, ()), ("traced", traced, (trace,))):
        launch(k, grid, threads, smem, tuple(args) + extra, stream)        # compile, warm
        times = []
        for _ in range(repeats):
            start, end = cuda.event(), cuda.event()
            start.record(on)
            launch(k, grid, threads, smem, tuple(args) + extra, stream)
            end.record(on)
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms[name] = _median(times)
    return trace.copy_to_host(), spec.tiling.BM // forward_wgmma.ROWS, ms["plain"], ms["traced"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="", help='calls "B,H,N,d,causal[,w=L][,c=C][,t];..." (as tools/ab.py)')
    p.add_argument("--varlen", action="store_true", help="add the causal varlen batch of bench.py serving")
    p.add_argument("--lens", default="", help='with --varlen: its sequence lengths, e.g. "384*16"')
    p.add_argument("--varlen-heads", default="16,128", help='with --varlen: "H,d"')
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--by-tiles", action="store_true",
                   help="also print the phases' medians of the items grouped by their key tiles (1-2, 3-4, ..., 33+)")
    p.add_argument("--json", default=None, help="write the summaries here")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a numba_flash constant for both kernels, e.g. kernels.forward_wgmma.X=True (repeatable)")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    lens = parse_lens(args.lens)
    if not shapes and not args.varlen:
        p.error("give --shapes or --varlen")
    import numpy as np
    import torch
    from numba import cuda
    from numba_flash import api
    import numba_flash
    set_constants(args.set)
    dt = getattr(torch, args.dtype)
    clock_khz = getattr(cuda.get_current_device(), "CLOCK_RATE", 1e6)     # (the simulator: none)
    calls = []          # (name, launches, query rows per sequence, leading indices)
    for B, H, N, d, causal, left, cap, tokens in shapes:
        q, k, v = shape_inputs(B, H, N, d, tokens, dt, torch)
        window = None if left is None else (left, 0 if causal else left)
        name = (f"({B},{H},{N},{d}){' causal' if causal else ''}{'' if left is None else f' window {left}'}"
                f"{'' if cap is None else f' softcap {cap:g}'}{' token-major' if tokens else ''}")
        result, launches = api.plan_forward(q, k, v, causal=bool(causal), window=window, softcap=cap)
        calls.append((name, launches, [N], B * H, (result, q, k, v)))      # (kept: the launches write there)
    if args.varlen:
        heads, d = (int(x) for x in args.varlen_heads.split(","))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        torch.manual_seed(0)
        q, k, v = (torch.randn(int(cu[-1]), heads, d, device="cuda", dtype=dt) for _ in range(3))
        seen = []                   # the launches of a first call (its full path: no plan yet)
        plain = api.launch
        api.launch = lambda *a: seen.append(a) or plain(*a)
        try:
            out = numba_flash.attention_varlen(q, k, v, cu, cu, causal=True)
        finally:
            api.launch = plain
        calls.append((f"varlen {len(lens)} sequences, {heads} heads, d = {d} causal", seen, list(lens), heads,
                      (out, q, k, v)))
    report = []
    for name, launches, rows, heads, _kept in calls:
        stamps, nwg, plain_ms, traced_ms = trace_call(launches, rows, heads)
        s = summarise(stamps, nwg)
        tile = s["tile"]
        print(f"== {name}: kernel {plain_ms:.4f} ms (item overlap off), traced {traced_ms:.4f} ms; {s['items']} "
              f"warpgroup items; clock {clock_khz / 1e3:.0f} MHz (the device's rate)")
        for key in ("place", "wait_q", "wait_k0", "first", "tile", "last", "store", "gap", "item"):
            cycles = s[key]
            print(f"   {key:8s} {cycles:10.0f} cycles  {cycles / clock_khz * 1e3:8.3f} us  {cycles / tile:6.2f} tiles")
        print(f"   fixed cost per item {s['fixed_tiles']:.2f} tiles; Q landed {s['q_lead']:.0f} cycles after the "
              f"producer issued it; blocks busy {s['busy_mean']:.0f} cycles on average, the longest "
              f"{s['busy_max'] / s['busy_mean'] - 1:+.1%}")
        if args.by_tiles:
            print("\n".join(by_tiles_lines(s)))
        report.append(dict(call=name, plain_ms=plain_ms, traced_ms=traced_ms, clock_khz=clock_khz, **s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
