"""Benchmark numba_flash against PyTorch SDPA, after checking it against the float64 oracle.

    python bench.py                        # = python bench.py forward: anchors + seed, float32
    python bench.py --quick                # (4, 16, 4096, 128) and the seed shape only
    python bench.py forward --shapes anchors --dtype float32,float64 --repeats 50
    python bench.py --tiny --json /tmp/b.json    # simulator-sized smoke run (tests/test_bench.py)

Every mode does the same four things, in this order:

1. **Validate** every configuration it will time: run the public API on the full inputs
   and compare a sub-slice of the result (first and last leading index, at most
   ``VALIDATE_ROWS`` query rows each, against the full K/V) with the float64 oracle
   ``numba_flash.reference``. A failure is printed loudly, the row is marked invalid, it
   is not timed, and the run exits with status 1.
2. **Time** the public API call (``numba_flash.attention_fwd``), so Python dispatch
   (input checks, kernel lookup, output allocation, launch) is *included*: each repeat
   is synchronised, L2 is flushed, then CUDA events bracket one call. Warm-up calls keep
   the JIT compile out; the median of at least ``--repeats`` repeats and ``--min-time``
   seconds is reported. The peers (``torch.nn.functional.scaled_dot_product_attention``
   with the EFFICIENT_ATTENTION and MATH backends, same input tensors) are timed the
   same way with ``torch.cuda.Event``; a peer that is unsupported or runs out of memory
   is reported as "—".
3. **Measure** the peak extra device memory of one call (ours: drop of the driver's free
   memory inside ``numba.cuda.defer_cleanup()``; torch: ``max_memory_allocated`` growth).
4. **Report**: JSON (environment, versions, git SHA, one record per row), optionally a
   Markdown fragment for docs/performance.md, and a fixed-width table printed last.

FLOPs follow the FlashAttention convention: forward = 4·B·H·Nq·Nk·d, halved when causal.

Adding a mode (``backward``, ``ladder``): write ``run_<mode>(args)`` (configs, validation
against the oracle, timing through ``measure``, a ``<MODE>_COLUMNS`` table; ending with
``print_summary``, which returns the exit status) and add one entry to ``MODES`` at the
bottom. Options shared by all modes live in ``_common_options``; the environment record,
timers, memory probes and JSON/Markdown/table writers are mode-agnostic.

Caveats: in Numba's CUDA simulator (no GPU) there are no CUDA events, so ``--tiny``
times with ``time.perf_counter`` and the numbers mean nothing; inputs there are NumPy
arrays (host round trip included). Free-memory deltas have the driver's allocation
granularity (2 MiB).
"""
import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import platform
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

import numba_flash  # first: decides GPU vs simulator before numba is imported
from numba_flash import SIMULATOR, _arrays, reference, registry

from numba import cuda  # noqa: E402  (after numba_flash, see above)

ROOT = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- configurations
@dataclasses.dataclass(frozen=True)
class Shape:
    """q (B, H, Nq, d); k, v (B, H, Nk, d)."""
    B: int
    H: int
    Nq: int
    Nk: int
    d: int

    def __str__(self):
        n = f"{self.Nq}" if self.Nq == self.Nk else f"{self.Nq}/{self.Nk}"
        return f"({self.B},{self.H},{n},{self.d})"


TOKENS, HIDDEN = 16384, 2048  # anchors: B·N = 16k tokens per batch, H·d = 2048 (FlashAttention-2 paper sweep)

SHAPE_SETS = {
    "anchors": [Shape(TOKENS // n, HIDDEN // d, n, n, d) for d in (64, 128) for n in (1024, 4096, 16384)],
    "seed": [Shape(1, 1, 1024, 1024, 1024)],   # the project's seed problem: one head, d = 1024
    # Simulator-sized; with the simulator's tiling (BM = 16, BN = 8, DK = DO = 16) these cross
    # ragged query/key tile edges, head-dim chunks (d = 24) and output slices.
    "tiny": [Shape(1, 2, 40, 40, 16), Shape(2, 1, 20, 20, 24)],
}
DEFAULT_SHAPES = ("anchors", "seed")
QUICK_SHAPES = [Shape(4, 16, 4096, 4096, 128), SHAPE_SETS["seed"][0]]
CAUSAL = (False, True)

TOLERANCE = {"float32": 2e-4, "float64": 1e-10}   # max abs error vs the float64 oracle (out and lse)
VALIDATE_ROWS = 512          # query rows checked per leading index (first and last half of them)
FULL_CHECK_HEADS = 4         # check every leading index when B·H is at most this
SEED = 0

# Timing
DEFAULT_REPEATS, DEFAULT_MIN_TIME_S, DEFAULT_WARMUP = 20, 1.0, 3
TINY_REPEATS = 2             # --tiny: the simulator takes ~1 s a call, and its times mean nothing
MAX_REPEATS = 1000           # stop here even if --min-time is not reached
L2_FLUSH_BYTES = 256 << 20   # written between repeats: > 4x the H200's 60 MB L2

# Peers: PyTorch SDPA backends. JSON key -> (table label, torch.nn.attention.SDPBackend member).
PEERS = {"sdpa_efficient": ("eff", "EFFICIENT_ATTENTION"), "sdpa_math": ("math", "MATH")}

MIB = 2.0 ** 20


def forward_flops(s: Shape, causal: bool) -> float:
    """FlashAttention convention: 2 matmuls of 2·Nq·Nk·d per head; causal does half the work."""
    f = 4.0 * s.B * s.H * s.Nq * s.Nk * s.d
    return f / 2 if causal else f


def select_shapes(args):
    if args.tiny:
        return list(SHAPE_SETS["tiny"])
    if args.quick:
        return list(QUICK_SHAPES)
    return [s for name in args.shapes for s in SHAPE_SETS[name]]


# --------------------------------------------------------------------------- environment
def _version(*dists):
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(*cmd):
    try:
        r = subprocess.run(("git",) + cmd, cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def load_torch():
    """torch, when it is importable and sees a GPU (and we are not in the simulator); else None."""
    if SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def gpu_info():
    if SIMULATOR:
        return {"name": "Numba CUDA simulator (no GPU)", "driver": None, "cuda_runtime": None}
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    info = {"name": name, "compute_capability": list(dev.compute_capability),
            "multiprocessors": getattr(dev, "MULTIPROCESSOR_COUNT", None)}
    for key, get in (("driver", lambda: cuda.cudadrv.driver.driver.get_version()),
                     ("cuda_runtime", lambda: cuda.runtime.get_version())):  # NVRTC's version in numba-cuda
        try:
            info[key] = ".".join(map(str, get()))
        except Exception:  # noqa: BLE001 - informative only
            info[key] = None
    return info


def environment(torch):
    sha = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_info(),
        "simulator": SIMULATOR,
        "git_sha": sha,
        "git_dirty": None if dirty is None else bool(dirty),
        "versions": {
            "python": platform.python_version(),
            "numba_flash": numba_flash.__version__,
            "numba": _version("numba"),
            "numba-cuda": _version("numba-cuda"),
            "numpy": np.__version__,
            "torch": _version("torch"),
            "torch_cuda": getattr(getattr(torch, "version", None), "cuda", None),
            "cupy": _version("cupy", "cupy-cuda13x", "cupy-cuda12x"),
            "triton": _version("triton"),
            "cuda-bindings": _version("cuda-bindings"),
        },
        "inputs": input_kind(torch),
    }
    if torch is not None:
        env["torch_allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return env


# --------------------------------------------------------------------------- arrays
def input_kind(torch):
    if torch is not None:
        return "torch"
    # Simulator: NumPy inputs (its "device" is host memory anyway; the API copies them each
    # call). Numba's simulated device arrays had shape quirks the API did not accept at first.
    return "numpy" if SIMULATOR else "numba"


def make_inputs(shape: Shape, dtype: str, kind: str, torch=None, seed=SEED):
    """q, k, v ~ N(0, 1) of the given kind; the same values every time for the same seed."""
    sizes = [(shape.B, shape.H, shape.Nq, shape.d)] + [(shape.B, shape.H, shape.Nk, shape.d)] * 2
    if kind == "torch":
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tdt = getattr(torch, dtype)
        return tuple(torch.randn(sz, generator=gen, device="cuda", dtype=tdt) for sz in sizes)
    rng = np.random.default_rng(seed)
    host = tuple(rng.standard_normal(sz, dtype=np.dtype(dtype)) for sz in sizes)
    return host if kind == "numpy" else tuple(cuda.to_device(a) for a in host)


def to_host(x):
    """NumPy copy of a NumPy array, Numba device array or torch tensor."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return x.detach().cpu().numpy()


def uses_async(arrays):
    """What the API will decide for these inputs (cp.async needs 16-byte aligned rows)."""
    devs = [_arrays.as_numba_device(a) if _arrays.is_device_array(a) else cuda.to_device(np.ascontiguousarray(a))
            for a in arrays]
    return all(_arrays.rows_aligned16(a) for a in devs)


# --------------------------------------------------------------------------- validation
def oracle_rows(q, k, v, r0, r1, *, causal):
    """Rows ``r0:r1`` of ``reference.attention_fwd(q, k, v, causal=causal)`` for one head.

    q (Nq, d), k and v (Nk, d), float64 NumPy. Only those query rows are computed, against
    the full K/V. Causal is bottom-right aligned (row i sees key j iff j <= i + Nk − Nq):
    rows below r1 see at most the first r1 + Nk − Nq keys, and with exactly those keys the
    reference's own bottom-right mask on the (r1 − r0)-row block is the full problem's.
    """
    if not causal:
        return reference.attention_fwd(q[r0:r1], k, v)
    kv = max(0, r1 + k.shape[0] - q.shape[0])
    return reference.attention_fwd(q[r0:r1], k[:kv], v[:kv], causal=True)


def validation_blocks(s: Shape):
    """(leading index, first row, end row) blocks of the output compared with the oracle."""
    if s.B * s.H <= FULL_CHECK_HEADS:
        leads = [(b, h) for b in range(s.B) for h in range(s.H)]
    else:
        leads = sorted({(0, 0), (s.B - 1, s.H - 1)})
    if s.Nq <= VALIDATE_ROWS:
        rows = [(0, s.Nq)]
    else:
        half = VALIDATE_ROWS // 2
        rows = [(0, half), (s.Nq - half, s.Nq)]
    return [(lead, r0, r1) for lead in leads for r0, r1 in rows]


def max_abs_err(got, want):
    """max |got − want|; equal infinities count as 0 and any NaN as inf."""
    got = np.asarray(got, np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.where(got == want, 0.0, np.abs(got - want))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max(initial=0.0))


def oracle_for(q, k, v, blocks, causal):
    """{block: (out, lse)} from the float64 oracle, one head's K/V copied to the host at a time."""
    refs = {}
    for lead in dict.fromkeys(b[0] for b in blocks):
        qh, kh, vh = (to_host(a[lead]).astype(np.float64) for a in (q, k, v))
        for blk in (b for b in blocks if b[0] == lead):
            refs[blk] = oracle_rows(qh, kh, vh, blk[1], blk[2], causal=causal)
    return refs


def compare_blocks(out, lse, refs):
    """(max error of out, of lse) over the checked blocks; lse may be None (peers)."""
    e_out = e_lse = 0.0
    for (lead, r0, r1), (ro, rl) in refs.items():
        e_out = max(e_out, max_abs_err(to_host(out[lead][r0:r1]), ro))
        if lse is not None:
            e_lse = max(e_lse, max_abs_err(to_host(lse[lead][r0:r1]), rl))
    return e_out, (e_lse if lse is not None else None)


def describe_blocks(blocks):
    leads = sorted({b[0] for b in blocks})
    rows = sorted({(b[1], b[2]) for b in blocks})
    return {"leading_indices": [list(x) for x in leads], "rows": [list(r) for r in rows]}


def validate_forward(cfg, arrays, refs):
    """Run the API once on the full inputs and compare the checked blocks with the oracle."""
    q, k, v = arrays
    tol = TOLERANCE[cfg["dtype"]]
    res = {"tolerance": tol, "checked": describe_blocks(list(refs)), "error": None,
           "out_err": None, "lse_err": None, "max_abs_err": None}
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, causal=cfg["causal"])
        e_out, e_lse = compare_blocks(out, lse, refs)
    except Exception as exc:  # noqa: BLE001 - reported, row marked invalid
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        res["valid"] = False
        return res
    res.update(out_err=e_out, lse_err=e_lse, max_abs_err=max(e_out, e_lse))
    res["valid"] = bool(res["max_abs_err"] <= tol)
    return res


# --------------------------------------------------------------------------- timing
class NumbaEvents:
    """CUDA events on the default stream, through Numba."""
    name = "numba.cuda.event"

    def synchronize(self):
        cuda.synchronize()

    def time(self, call):
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record()
        t0 = time.perf_counter()
        result = call()   # kept alive until the end event: no free inside the timed region
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        del result
        return start.elapsed_time(end), 1e3 * host


class TorchEvents:
    """CUDA events on torch's current stream."""
    name = "torch.cuda.Event"

    def __init__(self, torch):
        self.torch = torch

    def synchronize(self):
        self.torch.cuda.synchronize()

    def time(self, call):
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        result = call()   # kept alive until the end event: no free inside the timed region
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        del result
        return start.elapsed_time(end), 1e3 * host


class WallClock:
    """time.perf_counter around a (synchronous) simulator call: no CUDA events there."""
    name = "time.perf_counter (simulator)"

    def synchronize(self):
        cuda.synchronize()

    def time(self, call):
        t0 = time.perf_counter()
        call()
        cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        return ms, ms


def make_l2_flush():
    """A callable that overwrites more than the L2 cache (None in the simulator)."""
    if SIMULATOR:
        return None
    buf = cuda.device_array(L2_FLUSH_BYTES, dtype=np.uint8)
    return lambda: cuda.cudadrv.driver.device_memset(buf, 0, buf.nbytes)


def release_pending_frees():
    """Free the buffers Numba has queued for deallocation, so none is freed mid-measurement."""
    ctx = cuda.current_context()
    pending = getattr(ctx, "deallocations", None)
    if pending is not None:
        pending.clear()


def measure(call, events, bench):
    """Median-of-many time of ``call()`` after warm-up; each repeat synchronised and timed alone.

    Before every repeat: pending Numba frees released, L2 flushed (``bench.flush``), device
    synchronised; outside the timed region. Returns device (event) and host (dispatch) ms.
    """
    for _ in range(bench.warmup):
        call()
    events.synchronize()
    dev_ms, host_ms = [], []
    while len(dev_ms) < bench.repeats or (sum(dev_ms) < 1e3 * bench.min_time_s and len(dev_ms) < MAX_REPEATS):
        release_pending_frees()
        if bench.flush is not None:
            bench.flush()
        events.synchronize()
        d, h = events.time(call)
        dev_ms.append(d)
        host_ms.append(h)
    dev = np.asarray(dev_ms)
    return {"ms_median": float(np.median(dev)), "ms_min": float(dev.min()),
            "ms_p10": float(np.percentile(dev, 10)), "ms_p90": float(np.percentile(dev, 90)),
            "host_ms_median": float(np.median(host_ms)), "repeats": len(dev_ms), "timer": events.name}


def numba_extra_mib(call):
    """Drop in the driver's free device memory during one call (transients included), MiB.

    Inside ``defer_cleanup`` nothing Numba allocates during the call is freed before we
    read the free memory; the results are kept alive until then. None in the simulator.
    """
    gc.collect()
    release_pending_frees()
    cuda.synchronize()
    ctx = cuda.current_context()
    free0 = ctx.get_memory_info()[0]
    if not math.isfinite(free0):   # the simulator reports inf
        return None
    with cuda.defer_cleanup():
        result = call()
        cuda.synchronize()
        free1 = ctx.get_memory_info()[0]
        del result
    return (free0 - free1) / MIB


def torch_extra_mib(torch, call):
    """Peak growth of torch's allocated memory during one call, MiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - before) / MIB


@dataclasses.dataclass
class Bench:
    """What every timed row needs: timers, repeat policy, L2 flush, torch (or None)."""
    events: object
    repeats: int
    min_time_s: float
    warmup: int
    flush: object
    torch: object
    kind: str
    peers: tuple


# --------------------------------------------------------------------------- forward
def forward_configs(args):
    return [{"shape": s, "causal": c, "dtype": dt}
            for dt in args.dtype for s in select_shapes(args) for c in CAUSAL]


def kernel_record(cfg, use_async):
    s = cfg["shape"]
    spec = registry.forward_specialisation(cfg["dtype"], s.d, cfg["causal"], use_async)
    t = spec.tiling
    return {"kernel": spec.name, "variant": spec.variant, "use_async": spec.use_async,
            "tiling": dataclasses.asdict(t), "BM": t.BM, "BN": t.BN, "threads": t.threads,
            "smem_bytes": spec.smem_bytes,
            "grid": [-(-s.Nq // t.BM) * s.B * s.H, -(-s.d // t.DO)]}


def out_lse_mib(cfg):
    s = cfg["shape"]
    return s.B * s.H * s.Nq * (s.d + 1) * np.dtype(cfg["dtype"]).itemsize / MIB


def time_ours(cfg, arrays, bench):
    q, k, v = arrays
    call = lambda: numba_flash.attention_fwd(q, k, v, causal=cfg["causal"])  # noqa: E731
    try:
        rec = measure(call, bench.events, bench)
        rec["extra_mib"] = numba_extra_mib(call)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"error": f"{type(exc).__name__}: {exc}"}
    rec["tflops"] = forward_flops(cfg["shape"], cfg["causal"]) / (rec["ms_median"] * 1e-3) / 1e12
    return rec


def peer_unavailable(bench, cfg):
    if bench.torch is None:
        return "not run: torch not importable (or no GPU)"
    if not bench.peers:
        return "not run: --no-peers"
    s = cfg["shape"]
    if cfg["causal"] and s.Nq != s.Nk:
        return "SDPA is_causal is top-left aligned: differs from ours when Nq != Nk"
    return None


def time_peer(name, cfg, arrays, bench, refs):
    """One SDPA backend on the same tensors: error vs the oracle, time, extra memory."""
    torch = bench.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = arrays
    sdpa = torch.nn.functional.scaled_dot_product_attention
    call = lambda: sdpa(q, k, v, is_causal=cfg["causal"])  # noqa: E731
    try:
        with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, PEERS[name][1])):
            warnings.simplefilter("ignore")   # "memory efficient kernel not used because ..."
            err, _ = compare_blocks(call(), None, refs)
            rec = measure(call, TorchEvents(torch), bench)
            rec["extra_mib"] = torch_extra_mib(torch, call)
    except Exception as exc:  # noqa: BLE001 - unsupported ("No available kernel") or out of memory
        torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    torch.cuda.empty_cache()   # give MATH's score matrices back before the next row
    rec["max_abs_err"] = err
    rec["tflops"] = forward_flops(cfg["shape"], cfg["causal"]) / (rec["ms_median"] * 1e-3) / 1e12
    return rec


def ratio(ours, peer):
    if ours and peer and ours.get("tflops") and peer.get("tflops"):
        return ours["tflops"] / peer["tflops"]
    return None


def row_label(cfg):
    return f"{cfg['shape']} {'causal' if cfg['causal'] else 'full'} {cfg['dtype']}"


def validate_all(configs, bench):
    """Phase 1: every configuration against the oracle. Returns [(validation, refs)], one per config."""
    print(f"Validating {len(configs)} configurations against numba_flash.reference (float64, CPU) ...",
          flush=True)
    results = []
    for cfg in configs:
        arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
        refs = oracle_for(*arrays, validation_blocks(cfg["shape"]), cfg["causal"])
        val = validate_forward(cfg, arrays, refs)
        val["use_async"] = uses_async(arrays)
        results.append((val, refs))
        if val["valid"]:
            print(f"  ok       {row_label(cfg)}: max abs err {val['max_abs_err']:.2e} "
                  f"(tol {val['tolerance']:.0e})", flush=True)
        else:
            what = val["error"] or f"max abs err {val['max_abs_err']:.3e} > tol {val['tolerance']:.0e}"
            print(f"  INVALID  {row_label(cfg)}: {what}", flush=True)
            print(f"VALIDATION FAILED for {row_label(cfg)}: {what}\n{val.get('traceback', '')}",
                  file=sys.stderr, flush=True)
        del arrays
    return results


def time_all(configs, validated, bench):
    """Phase 2: time ours and the peers on each validated configuration."""
    print(f"Timing {len(configs)} configurations ({bench.events.name}; median of >= {bench.repeats} "
          f"repeats and >= {bench.min_time_s:g} s; peers: {', '.join(bench.peers) or 'none'}) ...", flush=True)
    rows = []
    for cfg, (val, refs) in zip(configs, validated):
        arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
        rec = {"mode": "forward", "shape": dataclasses.asdict(cfg["shape"]), "causal": cfg["causal"],
               "dtype": cfg["dtype"], "flops": forward_flops(cfg["shape"], cfg["causal"]),
               "valid": val["valid"], "validation": val,
               "ours": kernel_record(cfg, val["use_async"]), "peers": {}}
        rec["ours"]["out_lse_mib"] = out_lse_mib(cfg)
        val.pop("use_async")
        if val["valid"]:
            rec["ours"].update(time_ours(cfg, arrays, bench))
        else:
            rec["ours"]["error"] = "not timed: validation failed"
        reason = peer_unavailable(bench, cfg)
        for name in PEERS:
            peer = {"error": reason} if reason else time_peer(name, cfg, arrays, bench, refs)
            peer["backend"] = PEERS[name][1]
            peer["ratio"] = ratio(rec["ours"], peer)
            rec["peers"][name] = peer
        print(f"  {row_label(cfg)}: {_brief(rec)}", flush=True)
        rows.append(rec)
        del arrays
    return rows


def _brief(rec):
    parts = [f"ours {_fmt(rec['ours'].get('ms_median'), '.3f')} ms "
             f"{_fmt(rec['ours'].get('tflops'), '.2f')} TFLOP/s"]
    for name, p in rec["peers"].items():
        why = f" ({p['error']})" if p.get("error") else ""
        parts.append(f"{PEERS[name][0]} {_fmt(p.get('tflops'), '.2f')}{why}")
    return "; ".join(parts)


def run_forward(args):
    torch = load_torch()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False   # a true float32 MATH peer
    peers = () if torch is None or args.no_peers else tuple(PEERS)
    bench = Bench(events=WallClock() if SIMULATOR else NumbaEvents(),
                  repeats=args.repeats, min_time_s=args.min_time, warmup=args.warmup,
                  flush=None if args.no_flush_l2 else make_l2_flush(), torch=torch,
                  kind=input_kind(torch), peers=peers)
    env = environment(torch)
    print(_header(env), flush=True)
    configs = forward_configs(args)
    validated = validate_all(configs, bench)
    rows = time_all(configs, validated, bench)
    doc = {"mode": "forward", **env, "settings": _settings(args, bench), "rows": rows}
    write_json(args.json, doc)
    if args.markdown:
        write_markdown(args.markdown, doc, FORWARD_COLUMNS, forward_notes(doc))
    print(f"Wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))
    return print_summary(rows, FORWARD_COLUMNS, forward_notes(doc))


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


def _settings(args, bench):
    return {"repeats_min": bench.repeats, "min_time_s": bench.min_time_s, "warmup": bench.warmup,
            "max_repeats": MAX_REPEATS, "l2_flush_bytes": 0 if bench.flush is None else L2_FLUSH_BYTES,
            "timer": bench.events.name, "inputs": bench.kind, "peers": {n: PEERS[n][1] for n in bench.peers},
            "tolerance": TOLERANCE, "validate_rows": VALIDATE_ROWS, "seed": SEED,
            "flop_convention": "4*B*H*Nq*Nk*d, halved when causal",
            "timed_call": "numba_flash.attention_fwd (public API: Python dispatch included)",
            "argv": args.argv}


def _header(env):
    v = env["versions"]
    return (f"numba_flash bench · {env['date']} · {env['gpu']['name']} · git {(env['git_sha'] or '?')[:12]}"
            f"{' (dirty)' if env['git_dirty'] else ''} · numba {v['numba']}, numba-cuda {v['numba-cuda']}, "
            f"torch {v['torch'] or '—'} · inputs: {env['inputs']}")


def forward_notes(doc):
    s = doc["settings"]
    notes = [
        f"Times: median over >= {s['repeats_min']} repeats and >= {s['min_time_s']:g} s ({s['timer']}); each "
        "repeat is one call of the public API, synchronised before"
        + (", L2 flushed" if s["l2_flush_bytes"] else "") + ", so Python dispatch overhead is INCLUDED "
        "(JSON: host_ms_median).",
        "TFLOP/s: FlashAttention convention, 4·B·H·N²·d, halved when causal. ratio = ours TFLOP/s ÷ peer "
        "TFLOP/s (> 1: ours faster). Peers: torch SDPA "
        + (", ".join(f"{PEERS[n][0]} = {b}" for n, b in s["peers"].items()) or "not run")
        + ", same tensors; '—' = unsupported, out of memory or not run.",
        "extra MiB: drop of the device's free memory during one call (driver granularity 2 MiB), "
        "vs out+lse MiB, the theoretical output size. err: max abs error vs the float64 oracle (out, lse) "
        "on a sub-slice; tolerance " + ", ".join(f"{t:.0e} ({dt})" for dt, t in s["tolerance"].items()) + ".",
    ]
    if doc["simulator"]:
        notes.append("SIMULATOR: no GPU, timings are meaningless (validation only).")
    return notes


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


# (header, width, row -> text). Peer columns are generated from PEERS.
FORWARD_COLUMNS = (
    [("shape (B,H,N,d)", 18, lambda r: str(Shape(**r["shape"]))),
     ("causal", 6, lambda r: "yes" if r["causal"] else "no"),
     ("dtype", 7, lambda r: r["dtype"]),
     ("ours ms", 9, lambda r: _fmt(r["ours"].get("ms_median"), ".3f")),
     ("ours TF/s", 9, lambda r: _fmt(r["ours"].get("tflops"), ".2f"))]
    + [(f"{lbl} TF/s", 9, _peer(n, "tflops", ".2f")) for n, (lbl, _) in PEERS.items()]
    + [(f"ours/{lbl}", 9, _peer(n, "ratio", ".2f")) for n, (lbl, _) in PEERS.items()]
    + [("extra MiB", 9, lambda r: _fmt(r["ours"].get("extra_mib"), ".1f")),
       ("out+lse MiB", 11, lambda r: _fmt(r["ours"].get("out_lse_mib"), ".1f")),
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


# --------------------------------------------------------------------------- command line
def _csv_choice(choices):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"got {text!r}; choose a comma-separated subset of {', '.join(choices)}")
        return items
    return parse


def _common_options():
    """Options every mode takes (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--shapes", type=_csv_choice([k for k in SHAPE_SETS if k != "tiny"]),
                   default=list(DEFAULT_SHAPES),
                   help=f"shape sets, comma-separated (default: {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--dtype", type=_csv_choice(registry.DTYPES), default=["float32"],
                   help="dtypes, comma-separated, from " + ", ".join(registry.DTYPES) + " (default: float32)")
    p.add_argument("--quick", action="store_true", help="only " + ", ".join(map(str, QUICK_SHAPES)))
    p.add_argument("--tiny", action="store_true",
                   help="simulator-sized shapes, few repeats: a smoke test (works without a GPU)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"minimum timed repeats (default {DEFAULT_REPEATS}; {TINY_REPEATS} with --tiny)")
    p.add_argument("--min-time", type=float, default=None,
                   help=f"minimum total timed seconds per row (default {DEFAULT_MIN_TIME_S:g}; 0 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default {DEFAULT_WARMUP})")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch SDPA peers")
    p.add_argument("--no-flush-l2", action="store_true", help="do not overwrite L2 between repeats")
    p.add_argument("--json", default=None, help="JSON output (default: results/bench-<mode>.json)")
    p.add_argument("--markdown", default=None, help="also write the table as a Markdown fragment here")
    return p


@dataclasses.dataclass(frozen=True)
class Mode:
    help: str
    run: object   # args -> exit status


MODES = {
    "forward": Mode("fused forward vs PyTorch SDPA (default)", run_forward),
    # "backward": Mode(..., run_backward), "ladder": Mode(..., run_ladder): to come.
}
DEFAULT_MODE = "forward"


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in MODES and argv[0] not in ("-h", "--help")):
        argv.insert(0, DEFAULT_MODE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", metavar="MODE", help=f"default: {DEFAULT_MODE}")
    common = _common_options()
    for name, mode in MODES.items():
        sub.add_parser(name, parents=[common], help=mode.help).set_defaults(run=mode.run)
    args = parser.parse_args(argv)
    args.argv = argv
    tiny = args.tiny
    args.repeats = args.repeats if args.repeats is not None else (TINY_REPEATS if tiny else DEFAULT_REPEATS)
    args.min_time = args.min_time if args.min_time is not None else (0.0 if tiny else DEFAULT_MIN_TIME_S)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else DEFAULT_WARMUP)
    args.json = args.json or str(ROOT / "results" / f"bench-{args.mode}.json")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv=None):
    args = parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
