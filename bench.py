"""Benchmark numba_flash against PyTorch SDPA, after checking it against the float64 oracle.

    python bench.py                        # = python bench.py forward: anchors + seed, float32
    python bench.py --quick                # (4, 16, 4096, 128) and the seed shape only
    python bench.py forward --shapes anchors --dtype float32,float64 --repeats 50
    python bench.py --tiny --json /tmp/b.json    # simulator-sized smoke run (tests/test_bench.py)
    python bench.py backward               # attention_bwd vs SDPA backward, same shapes and options
    python bench.py ladder                 # the kernel ladder (numba_flash.ladder) on the seed problem
    python bench.py ladder --tiny          # ... in the simulator, as a smoke test
    python bench.py variants               # GQA, windows, softcap, ALiBi vs the plain call, SDPA, FlexAttention

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
   seconds is reported. The kernels alone (the launches ``api.plan_forward`` /
   ``plan_backward`` prepare for the same call) are timed the same way, so the table shows
   how much of each call is host work. The peers (``torch.nn.functional.scaled_dot_product_attention``
   with the EFFICIENT_ATTENTION and MATH backends, same input tensors) are timed the
   same way with ``torch.cuda.Event``; a peer that is unsupported or runs out of memory
   is reported as "—".
3. **Measure** the peak extra device memory of one call (ours: drop of the driver's free
   memory inside ``numba.cuda.defer_cleanup()``; torch: ``max_memory_allocated`` growth).
4. **Report**: JSON (environment, versions, git SHA, one record per row), optionally a
   Markdown fragment for docs/performance.md, and a fixed-width table printed last.

FLOPs follow the FlashAttention convention: forward = 4·B·H·Nq·Nk·d, halved when causal;
backward = 2.5 × forward.

The ``backward`` mode differs only where the backward must: it validates dq, dk, dv of
``numba_flash.attention_bwd`` for the first leading index against
``reference.attention_bwd`` on the timed inputs when N <= ``BWD_FULL_N``, and otherwise on a
separately generated problem of the same B, H, d, causality and dtype with N =
``BWD_VALIDATE_N`` (dK/dV depend on every query row, so it cannot be checked on a row
slice); it times ``attention_bwd`` alone (out and lse precomputed by ``attention_fwd``),
and the peers' ``torch.autograd.grad`` through an SDPA output (graph retained).

The ``ladder`` mode reproduces the seed article's Results table with the rungs of
``numba_flash.ladder.RUNGS``: one row per rung (not per shape), on N = d = 1024 (``--n``,
``--d``; ``--shapes``, ``--dtype`` and the peers do not apply) with the seed's input
distribution. Each rung is validated on the timed inputs
(every element, against ``reference.attention``; pass/fail at 1e-4, the seed's tolerance),
then ``rung(q, k, v)`` on device arrays is timed as above. It writes the JSON, a bar chart
next to it (when matplotlib is importable) and the table (rung, change, ms, × vs the
previous rung, TFLOP/s, max abs error, pass/fail, the seed's C++ time on an H200).
``python docs/gen_ladder.py --results <json>`` puts the table into docs/ladder.md.

Adding a mode: write a ``validate_one(cfg, bench)`` and a ``time_one(cfg, val, ctx, bench)``
(see ``validate_forward_config`` / ``time_forward_row``), a ``<MODE>_COLUMNS`` table and
its notes, a ``run_<mode>(args)`` that hands them to ``run_mode`` (or, when its rows are not
shapes, to ``validate_all`` / ``time_all`` as ``run_ladder`` does), and one entry in
``MODES`` at the bottom (with ``options`` for its own command-line options). Options
shared by all modes live in ``_common_options``; the environment record, input
generation, timers, memory probes, peer wrapper and JSON/Markdown/table writers are
mode-agnostic.

Caveats: in Numba's CUDA simulator (no GPU) only ``--tiny`` runs (any other run stops at
once and says so); there are no CUDA events there, so it times with
``time.perf_counter`` and the numbers mean nothing; inputs there are NumPy
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

import ml_dtypes
import numpy as np

import numba_flash  # first: decides GPU vs simulator before numba is imported
from numba_flash import SIMULATOR, _arrays, api, families, reference, registry, scores
from numba_flash.launch import launch
from numba_flash.kernels.backward_mma import stats_rows

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
    "tiny": [Shape(1, 2, 19, 19, 16), Shape(2, 1, 11, 11, 24)],
}
DEFAULT_SHAPES = ("anchors", "seed")
QUICK_SHAPES = [Shape(4, 16, 4096, 4096, 128), SHAPE_SETS["seed"][0]]
CAUSAL = (False, True)

# max abs error vs the float64 oracle (out and lse); 16-bit: about four units in the last place
# of the largest outputs (|out| < 2 for these standard-normal inputs), the output's own rounding
TOLERANCE = {"float32": 2e-4, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}
VALIDATE_ROWS = 512          # query rows checked per leading index (first and last half of them)
FULL_CHECK_HEADS = 4         # check every leading index when B·H is at most this
SEED = 0

# Timing
DEFAULT_REPEATS, DEFAULT_MIN_TIME_S, DEFAULT_WARMUP = 20, 1.0, 3
TINY_REPEATS = 2             # --tiny: the simulator takes ~1 s a call, and its times mean nothing
MAX_REPEATS = 1000           # stop here even if --min-time is not reached
L2_FLUSH_BYTES = 256 << 20   # written between repeats: > 4x the H200's 60 MB L2

# Peers: PyTorch SDPA backends. JSON key -> (table label, torch.nn.attention.SDPBackend member),
# and the dtypes each is timed for (FlashAttention-2 and cuDNN take only 16-bit inputs; MATH on
# 16-bit inputs would only measure its O(N^2) score matrices).
PEERS = {"sdpa_flash": ("flash", "FLASH_ATTENTION"), "sdpa_cudnn": ("cudnn", "CUDNN_ATTENTION"),
         "sdpa_efficient": ("eff", "EFFICIENT_ATTENTION"), "sdpa_math": ("math", "MATH")}
PEER_DTYPES = {"sdpa_flash": registry.LOW_DTYPES, "sdpa_cudnn": registry.LOW_DTYPES,
               "sdpa_efficient": registry.DTYPES + registry.LOW_DTYPES, "sdpa_math": registry.DTYPES}
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}

# Backward mode
# per gradient: max abs err <= tol · max(1, max|oracle|); 16-bit as the forward's (P and dS are rounded)
BWD_TOLERANCE = {"float32": 3e-4, "float64": 1e-9, "float16": 4e-3, "bfloat16": 3e-2}
BWD_FULL_N = 1024            # validate on the timed inputs themselves up to this Nq and Nk ...
BWD_VALIDATE_N = 512         # ... else on a separate problem with N = this (same B, H, d, causal, dtype)
BWD_FLOP_FACTOR = 2.5        # FlashAttention convention: backward = 2.5 x forward FLOPs
BWD_LEAD = (0, 0)            # the leading index compared with the oracle
GRADS = ("dq", "dk", "dv")

MIB = 2.0 ** 20


def forward_flops(s: Shape, causal: bool) -> float:
    """FlashAttention convention: 2 matmuls of 2·Nq·Nk·d per head; causal does half the work."""
    f = 4.0 * s.B * s.H * s.Nq * s.Nk * s.d
    return f / 2 if causal else f


def backward_flops(s: Shape, causal: bool) -> float:
    return BWD_FLOP_FACTOR * forward_flops(s, causal)


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
    return random_arrays(sizes, dtype, kind, torch, seed)


def make_dout(shape: Shape, dtype: str, kind: str, torch=None, seed=SEED + 1):
    """The backward's incoming gradient dout ~ N(0, 1), shaped like q (its own seed)."""
    return random_arrays([(shape.B, shape.H, shape.Nq, shape.d)], dtype, kind, torch, seed)[0]


def random_arrays(sizes, dtype: str, kind: str, torch=None, seed=SEED):
    """Standard-normal arrays of these sizes and kind ("torch", "numpy", "numba"), reproducibly."""
    if kind == "torch":
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tdt = getattr(torch, dtype)
        return tuple(torch.randn(sz, generator=gen, device="cuda", dtype=tdt) for sz in sizes)
    rng = np.random.default_rng(seed)
    host = tuple(rng.standard_normal(sz).astype(NP_DTYPES[dtype]) for sz in sizes)
    return host if kind == "numpy" else tuple(cuda.to_device(a) for a in host)


def to_host(x):
    """NumPy copy of a NumPy array, Numba device array or torch tensor."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if str(x.dtype) == "torch.bfloat16":     # NumPy has no bfloat16 of its own
        return x.detach().float().cpu().numpy().astype(NP_DTYPES["bfloat16"])
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
    kv = scores.key_end(scores.spec_of(causal), r0, r1 - r0, q.shape[0], k.shape[0])
    return reference.attention_fwd(q[r0:r1], k[:kv], v[:kv], causal=causal)


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
def _time_between(start, end, call):
    """(device ms, host ms) of ``call()`` between two CUDA events (Numba's or PyTorch's)."""
    start.record()
    t0 = time.perf_counter()
    result = call()   # kept alive until the end event: no free inside the timed region
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    del result
    return start.elapsed_time(end), 1e3 * host


class NumbaEvents:
    """CUDA events on the default stream, through Numba."""
    name = "numba.cuda.event"

    def synchronize(self):
        cuda.synchronize()

    def time(self, call):
        return _time_between(cuda.event(timing=True), cuda.event(timing=True), call)


class TorchEvents:
    """CUDA events on torch's current stream."""
    name = "torch.cuda.Event"

    def __init__(self, torch):
        self.torch = torch

    def synchronize(self):
        self.torch.cuda.synchronize()

    def time(self, call):
        return _time_between(self.torch.cuda.Event(enable_timing=True),
                             self.torch.cuda.Event(enable_timing=True), call)


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
    """Peak extra device memory of one call (transients included), MiB: the peak growth of
    numba_flash's memory pool (outputs and any device copies come from it) plus the drop
    in the driver's free memory outside the pool.

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
    used0, _, reserved0 = _arrays.pool_usage()     # (resets the pool's peak)
    with cuda.defer_cleanup():
        result = call()
        cuda.synchronize()
        free1 = ctx.get_memory_info()[0]
        _, peak, reserved1 = _arrays.pool_usage()
        del result
    outside_pool = (free0 - free1) - (reserved1 - reserved0)
    return (max(outside_pool, 0) + max(peak - used0, 0)) / MIB


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


def spec_record(spec, s: Shape, rows):
    """A kernel specialisation as the JSON records it; ``rows`` is what its grid's x axis tiles."""
    t = spec.tiling
    return {"kernel": spec.name, "variant": spec.variant, "use_async": spec.use_async,
            "tiling": dataclasses.asdict(t), "BM": t.BM, "BN": t.BN, "threads": t.threads,
            "smem_bytes": spec.smem_bytes,
            "grid": [-(-rows // t.BM) * s.B * s.H, -(-s.d // t.DO)]}


def time_numba(call, bench, flops, plan=None, op=None):
    """``measure`` one call of ours, then, given ``plan`` (``plan()`` returns the launches
    the call makes: ``api.plan_forward`` / ``plan_backward``), its kernels alone, given
    ``op`` the same call through ``numba_flash.torch``'s custom op, then its peak extra
    device memory; errors go in the record."""
    try:
        rec = measure(call, bench.events, bench)
        if op is not None:
            rec["op_ms_median"] = measure(op, bench.events, bench)["ms_median"]
        if plan is not None:
            _, launches = plan()
            rec["kernel_ms_median"] = measure(lambda: [launch(*args) for args in launches],
                                              bench.events, bench)["ms_median"]
        rec["extra_mib"] = numba_extra_mib(call)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"error": f"{type(exc).__name__}: {exc}"}
    rec["tflops"] = flops / (rec["ms_median"] * 1e-3) / 1e12
    if plan is not None:
        rec["kernel_tflops"] = flops / (rec["kernel_ms_median"] * 1e-3) / 1e12
    return rec


def time_torch(call, bench, flops):
    """``measure`` one torch call with torch's events, then its ``max_memory_allocated`` growth."""
    rec = measure(call, TorchEvents(bench.torch), bench)
    rec["extra_mib"] = torch_extra_mib(bench.torch, call)
    rec["tflops"] = flops / (rec["ms_median"] * 1e-3) / 1e12
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


def run_peer(name, bench, body):
    """``body()`` (-> record) with SDPA restricted to peer ``name``'s backend.

    An unsupported backend ("No available kernel") or running out of memory gives
    ``{"error": ...}``; torch's cache is emptied after either way (MATH's score matrices).
    """
    torch = bench.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, PEERS[name][1])):
            warnings.simplefilter("ignore")   # "memory efficient kernel not used because ..."
            rec = body()
    except Exception as exc:  # noqa: BLE001 - unsupported or out of memory
        rec = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    finally:
        torch.cuda.empty_cache()
    return rec


def add_peers(rec, cfg, bench, time_peer):
    """Fill ``rec["peers"]``: ``time_peer(name)`` for each SDPA backend, or why it was not run."""
    reason = peer_unavailable(bench, cfg)
    for name in PEERS:
        why = reason or (None if cfg["dtype"] in PEER_DTYPES[name] else f"not run for {cfg['dtype']}")
        peer = {"error": why} if why else time_peer(name)
        peer["backend"] = PEERS[name][1]
        peer["ratio"] = ratio(rec["ours"], peer)
        rec["peers"][name] = peer


def new_record(mode, cfg, flops, val):
    return {"mode": mode, "shape": dataclasses.asdict(cfg["shape"]), "causal": cfg["causal"],
            "dtype": cfg["dtype"], "flops": flops, "valid": val["valid"], "validation": val,
            "ours": {}, "peers": {}}


def ratio(ours, peer):
    if ours and peer and ours.get("tflops") and peer.get("tflops"):
        return ours["tflops"] / peer["tflops"]
    return None


def row_label(cfg):
    if "label" in cfg:                   # modes whose rows are not (shape, causal, dtype)
        return cfg["label"]
    return f"{cfg['shape']} {'causal' if cfg['causal'] else 'full'} {cfg['dtype']}"


def validate_all(configs, bench, validate_one):
    """Phase 1: every configuration against the oracle.

    ``validate_one(cfg, bench)`` returns ``(validation record, context for time_one)``; the
    record has ``valid``, ``error`` (and ``traceback``), ``max_abs_err`` and ``summary``.
    """
    print(f"Validating {len(configs)} configurations against numba_flash.reference (float64, CPU) ...",
          flush=True)
    results = []
    for cfg in configs:
        val, ctx = validate_one(cfg, bench)
        results.append((val, ctx))
        if val["valid"]:
            print(f"  ok       {row_label(cfg)}: {val['summary']}", flush=True)
        else:
            what = val["error"] or val["summary"]
            print(f"  INVALID  {row_label(cfg)}: {what}", flush=True)
            print(f"VALIDATION FAILED for {row_label(cfg)}: {what}\n{val.get('traceback', '')}",
                  file=sys.stderr, flush=True)
    return results


def time_all(configs, validated, bench, time_one):
    """Phase 2: ``time_one(cfg, val, ctx, bench)`` (-> row record) for each configuration."""
    print(f"Timing {len(configs)} configurations ({bench.events.name}; median of >= {bench.repeats} "
          f"repeats and >= {bench.min_time_s:g} s; peers: {', '.join(bench.peers) or 'none'}) ...", flush=True)
    rows = []
    for cfg, (val, ctx) in zip(configs, validated):
        rec = time_one(cfg, val, ctx, bench)
        print(f"  {row_label(cfg)}: {_brief(rec)}", flush=True)
        rows.append(rec)
    return rows


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
    validated = validate_all(configs, bench, validate_one)
    rows = time_all(configs, validated, bench, time_one)
    doc = {"mode": mode, **env, "settings": {**_settings(args, bench), **settings}, "rows": rows}
    write_json(args.json, doc)
    if args.markdown:
        write_markdown(args.markdown, doc, columns, notes(doc))
    print(f"Wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))
    return print_summary(rows, columns, notes(doc))


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
            "seed": SEED, "argv": args.argv}


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


# --------------------------------------------------------------------------- forward
def forward_configs(args):
    return mode_configs(args)


def launch_records(launches):
    """What one call launches (from ``api.plan_forward`` / ``plan_backward``), as the JSON
    records it: kernel name, grid, block, dynamic shared memory and tiling per launch."""
    out = []
    for kern, grid, block, smem, _args, _stream in launches:
        fn = getattr(kern, "py_func", None) or getattr(kern, "fn", None)
        t = getattr(kern, "tiling", None)
        out.append({"kernel": getattr(fn, "__name__", repr(kern)),
                    "grid": list(grid) if isinstance(grid, tuple) else [grid], "block": block,
                    "smem_bytes": smem, "tiling": dataclasses.asdict(t) if dataclasses.is_dataclass(t) else None})
    return out


def kernel_record(cfg, use_async):
    s = cfg["shape"]
    spec = registry.forward_specialisation(cfg["dtype"], s.d, scores.spec_of(cfg["causal"]), use_async)
    return spec_record(spec, s, s.Nq)


def out_lse_mib(cfg):
    s = cfg["shape"]
    lse_bytes = 4 if cfg["dtype"] in registry.LOW_DTYPES else NP_DTYPES[cfg["dtype"]].itemsize
    return s.B * s.H * s.Nq * (s.d * NP_DTYPES[cfg["dtype"]].itemsize + lse_bytes) / MIB


def time_ours(cfg, arrays, bench):
    q, k, v = arrays
    call = lambda: numba_flash.attention_fwd(q, k, v, causal=cfg["causal"])  # noqa: E731
    plan = lambda: api.plan_forward(q, k, v, causal=cfg["causal"])  # noqa: E731
    op = None
    if bench.kind == "torch":
        import numba_flash.torch as nft
        op = lambda: nft.attention_fwd(q, k, v, causal=cfg["causal"])  # noqa: E731
    return time_numba(call, bench, forward_flops(cfg["shape"], cfg["causal"]), plan, op)


def time_peer(name, cfg, arrays, bench, refs):
    """One SDPA backend on the same tensors: error vs the oracle, time, extra memory."""
    q, k, v = arrays
    sdpa = bench.torch.nn.functional.scaled_dot_product_attention
    call = lambda: sdpa(q, k, v, is_causal=cfg["causal"])  # noqa: E731

    def body():
        err, _ = compare_blocks(call(), None, refs)
        rec = time_torch(call, bench, forward_flops(cfg["shape"], cfg["causal"]))
        rec["max_abs_err"] = err
        return rec
    return run_peer(name, bench, body)


def validate_forward_config(cfg, bench):
    arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
    refs = oracle_for(*arrays, validation_blocks(cfg["shape"]), cfg["causal"])
    val = validate_forward(cfg, arrays, refs)
    val["use_async"] = uses_async(arrays)
    val["summary"] = (f"max abs err {val['max_abs_err']:.2e} (tol {val['tolerance']:.0e})"
                      if val["max_abs_err"] is not None else None)
    return val, refs


def time_forward_row(cfg, val, refs, bench):
    arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
    val.pop("summary")
    rec = new_record("forward", cfg, forward_flops(cfg["shape"], cfg["causal"]), val)
    rec["ours"] = kernel_record(cfg, val.pop("use_async"))
    rec["ours"]["out_lse_mib"] = out_lse_mib(cfg)
    rec["ours"]["launches"] = launch_records(api.plan_forward(*arrays, causal=cfg["causal"])[1])   # key splits
    if val["valid"]:
        rec["ours"].update(time_ours(cfg, arrays, bench))
    else:
        rec["ours"]["error"] = "not timed: validation failed"
    add_peers(rec, cfg, bench, lambda name: time_peer(name, cfg, arrays, bench, refs))
    return rec


def run_forward(args):
    settings = {"tolerance": TOLERANCE, "validate_rows": VALIDATE_ROWS,
                "flop_convention": "4*B*H*Nq*Nk*d, halved when causal",
                "timed_call": "numba_flash.attention_fwd (public API: Python dispatch included)"}
    return run_mode(args, "forward", validate_forward_config, time_forward_row,
                    FORWARD_COLUMNS, forward_notes, settings)


def forward_notes(doc):
    s = doc["settings"]
    return common_notes(doc, "one call of the public API", "4·B·H·N²·d, halved when causal") + [
        "extra MiB: peak extra device memory of one call (numba_flash's pool high-water mark, plus "
        "any drop of the driver's free memory outside it, granularity 2 MiB), vs out+lse MiB, the theoretical output size. err: max abs error vs the float64 oracle (out, lse) "
        "on a sub-slice; tolerance " + ", ".join(f"{t:.0e} ({dt})" for dt, t in s["tolerance"].items()) + ".",
    ] + simulator_notes(doc)


# --------------------------------------------------------------------------- backward
def backward_validation_shape(s: Shape) -> Shape:
    """The problem dq, dk, dv are checked on: the timed one when small enough, else a smaller one
    with the same B, H, d (so the same kernels, tiling and launch path)."""
    if max(s.Nq, s.Nk) <= BWD_FULL_N:
        return s
    return Shape(s.B, s.H, min(s.Nq, BWD_VALIDATE_N), min(s.Nk, BWD_VALIDATE_N), s.d)


def backward_inputs(shape, dtype, bench):
    """q, k, v and dout of the given shape, as the mode generates them everywhere."""
    q, k, v = make_inputs(shape, dtype, bench.kind, bench.torch)
    return q, k, v, make_dout(shape, dtype, bench.kind, bench.torch)


def backward_oracle(q, k, v, dout, causal, lead=BWD_LEAD):
    """{"dq", "dk", "dv"} of leading index ``lead`` from ``reference.attention_bwd`` (float64)."""
    qh, kh, vh, dh = (to_host(a[lead]).astype(np.float64) for a in (q, k, v, dout))
    return dict(zip(GRADS, reference.attention_bwd(dh, qh, kh, vh, causal=causal)))


def compare_grads(grads, refs, rel_tol, lead=BWD_LEAD):
    """Per gradient: max abs error at ``lead``, max |oracle| and the bound ``rel_tol·max(1, max|oracle|)``."""
    res = {}
    for name, g in zip(GRADS, grads):
        ref = refs[name]
        ref_max = float(np.max(np.abs(ref), initial=0.0))
        res[name] = {"max_abs_err": max_abs_err(to_host(g[lead]), ref), "ref_max_abs": ref_max,
                     "tolerance": rel_tol * max(1.0, ref_max)}
    return res


def validate_backward_config(cfg, bench):
    """Run attention_fwd, then attention_bwd on full tensors; dq, dk, dv of one head vs the oracle.

    Returns the record and the oracle's gradients when they are of the timed inputs (for
    the peers' errors), else None.
    """
    s, causal = cfg["shape"], cfg["causal"]
    vs = backward_validation_shape(s)
    rel = BWD_TOLERANCE[cfg["dtype"]]
    val = {"tolerance_rel": rel, "problem": dataclasses.asdict(vs), "same_inputs": vs == s,
           "leading_index": list(BWD_LEAD), "error": None, "grads": None, "max_abs_err": None,
           "max_err_over_tol": None, "summary": None}
    try:
        q, k, v, dout = backward_inputs(vs, cfg["dtype"], bench)
        refs = backward_oracle(q, k, v, dout, causal)
        out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=causal)
        per = compare_grads(grads, refs, rel)
    except Exception as exc:  # noqa: BLE001 - reported, row marked invalid
        val["error"] = f"{type(exc).__name__}: {exc}"
        val["traceback"] = traceback.format_exc()
        val["valid"] = False
        return val, None
    worst = max(g["max_abs_err"] / g["tolerance"] for g in per.values())
    val.update(grads=per, max_abs_err=max(g["max_abs_err"] for g in per.values()), max_err_over_tol=worst)
    val["valid"] = bool(all(g["max_abs_err"] <= g["tolerance"] for g in per.values()))
    val["summary"] = ("max abs err " + ", ".join(f"{n} {g['max_abs_err']:.2e}" for n, g in per.items())
                      + f" (worst err/tol {worst:.1e}; tol {rel:.0e}·max(1, max|ref|)"
                      + ("" if vs == s else f"; on {vs}") + ")")
    return val, (refs if vs == s else None)


def backward_kernels(cfg, use_async):
    """The dK/dV and dQ specialisations attention_bwd launches (the delta pre-pass has no tiling)."""
    s, rules = cfg["shape"], scores.spec_of(cfg["causal"])
    dkdv, dq = families.BACKWARD_FAMILIES[cfg["dtype"] in registry.LOW_DTYPES]
    return {variant: spec_record(registry.specialisation(variant, cfg["dtype"], s.d, rules, use_async), s, rows)
            for variant, rows in ((dkdv, s.Nk), (dq, s.Nq))}


def grads_mib(cfg):
    """Theoretical extra memory of the backward: dq, dk, dv and the pre-pass's rows (delta,
    one value per query row; for 16-bit inputs lse in log2 units and delta, float32,
    padded to ``backward_mma.STATS_ROWS``)."""
    s = cfg["shape"]
    if cfg["dtype"] in registry.LOW_DTYPES:
        stats = 2 * 4 * stats_rows(s.Nq)
    else:
        stats = s.Nq * registry.itemsize(cfg["dtype"])
    return s.B * s.H * ((s.Nq + 2 * s.Nk) * s.d * registry.itemsize(cfg["dtype"]) + stats) / MIB


def time_backward_ours(cfg, q, k, v, dout, bench):
    """Time attention_bwd alone: out and lse come from one attention_fwd call before."""
    causal = cfg["causal"]
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"error": f"forward failed: {type(exc).__name__}: {exc}"}
    call = lambda: numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    plan = lambda: api.plan_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    op = None
    if bench.kind == "torch":
        from numba_flash import torch as _registers_the_op  # noqa: F401
        bwd = bench.torch.ops.numba_flash.attention_bwd
        op = lambda: bwd(dout, q, k, v, out, lse, causal, None, -1, -1, None, None)  # noqa: E731
    return time_numba(call, bench, backward_flops(cfg["shape"], causal), plan, op)


def time_backward_peer(name, cfg, q, k, v, dout, bench, refs):
    """One SDPA backend: forward once (graph kept), then time ``autograd.grad`` (ours: attention_bwd)."""
    torch = bench.torch
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def body():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        out = sdpa(qg, kg, vg, is_causal=cfg["causal"])
        call = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)  # noqa: E731
        per = None if refs is None else compare_grads(call(), refs, BWD_TOLERANCE[cfg["dtype"]])
        rec = time_torch(call, bench, backward_flops(cfg["shape"], cfg["causal"]))
        rec["grads"] = per
        rec["max_abs_err"] = None if per is None else max(g["max_abs_err"] for g in per.values())
        return rec
    return run_peer(name, bench, body)


def time_backward_row(cfg, val, refs, bench):
    q, k, v, dout = backward_inputs(cfg["shape"], cfg["dtype"], bench)
    val.pop("summary")
    rec = new_record("backward", cfg, backward_flops(cfg["shape"], cfg["causal"]), val)
    use_async = uses_async((q, k, v, dout))
    rec["ours"] = {"use_async": use_async, "kernels": backward_kernels(cfg, use_async),
                   "grads_mib": grads_mib(cfg)}
    if val["valid"]:
        rec["ours"].update(time_backward_ours(cfg, q, k, v, dout, bench))
    else:
        rec["ours"]["error"] = "not timed: validation failed"
    add_peers(rec, cfg, bench, lambda name: time_backward_peer(name, cfg, q, k, v, dout, bench, refs))
    return rec


def run_backward(args):
    low = [dt for dt in args.dtype if dt not in registry.dtypes("backward")]
    if low:
        sys.exit(f"bench.py backward: no {', '.join(low)} backward yet; choose from {', '.join(registry.dtypes('backward'))}")
    settings = {"tolerance": BWD_TOLERANCE, "tolerance_kind": "per gradient: max abs err <= tol * max(1, max|ref|)",
                "validation": {"leading_index": list(BWD_LEAD), "full_inputs_up_to_n": BWD_FULL_N,
                               "else_separate_problem_n": BWD_VALIDATE_N},
                "flop_convention": f"{BWD_FLOP_FACTOR} * forward (4*B*H*Nq*Nk*d, halved when causal)",
                "timed_call": "numba_flash.attention_bwd with out, lse precomputed (public API: Python "
                              "dispatch included); peers: torch.autograd.grad(out, (q, k, v), dout, "
                              "retain_graph=True)"}
    return run_mode(args, "backward", validate_backward_config, time_backward_row,
                    BACKWARD_COLUMNS, backward_notes, settings)


def backward_notes(doc):
    s = doc["settings"]
    return common_notes(doc, "one attention_bwd call (out, lse precomputed; peers: autograd.grad through "
                        "an SDPA output)", f"{BWD_FLOP_FACTOR:g} × forward (4·B·H·N²·d, halved when causal)") + [
        "extra MiB: peak extra device memory of one attention_bwd call (pool high-water mark, plus any "
        "drop of the driver's free memory outside it), vs grads MiB = dq+dk+dv+delta, the theoretical size; peers' max_memory_allocated growth "
        "in the JSON. err: max abs error of dq, dk, dv vs the float64 oracle for leading index (0,0), on "
        f"the timed inputs when N <= {BWD_FULL_N}, else on a separate N = {BWD_VALIDATE_N} problem; "
        "tolerance " + ", ".join(f"{t:.0e}" for t in s["tolerance"].values())
        + " (" + ", ".join(s["tolerance"]) + ") × max(1, max|ref|), per gradient.",
    ] + simulator_notes(doc)


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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
    validated = validate_all(configs, bench, validate_ladder_config)
    rows = time_all(configs, validated, bench, time_ladder_row)
    add_speedups(rows)
    n, d = configs[0]["n"], configs[0]["d"]
    settings = {**_settings(args, bench), "peers": {}, "problem": {"N": n, "d": d, "dtype": "float32"},
                "inputs_distribution": "(r mod 5) + 0.01 (r' mod 5), random sign (the seed's)",
                "tolerance": LADDER_TOLERANCE, "flop_convention": "4*N*N*d",
                "timed_call": "numba_flash.ladder rung(q, k, v), device arrays in and out"}
    doc = {"mode": "ladder", **env, "settings": settings, "rows": rows}
    write_json(args.json, doc)
    png = args.png or str(Path(args.json).with_suffix(".png"))
    charted = ladder_chart(doc, png)
    if args.markdown:
        write_markdown(args.markdown, doc, LADDER_COLUMNS, ladder_notes(doc))
    print(f"Wrote {args.json}" + (f", {png}" if charted else " (no chart: matplotlib is not importable)")
          + (f" and {args.markdown}" if args.markdown else ""))
    return print_summary(rows, LADDER_COLUMNS, ladder_notes(doc))


def ladder_options(p):
    p.add_argument("--n", type=int, default=LADDER_SHAPE[0], help=f"sequence length N (default {LADDER_SHAPE[0]})")
    p.add_argument("--d", type=int, default=LADDER_SHAPE[1], help=f"head dim d (default {LADDER_SHAPE[1]})")
    p.add_argument("--rungs", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="comma-separated rung numbers (default: all)")
    p.add_argument("--png", default=None, help="bar chart path (default: the JSON path with .png)")


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


FORWARD_COLUMNS = make_columns("out+lse MiB", "out_lse_mib")
BACKWARD_COLUMNS = make_columns("grads MiB", "grads_mib")


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


# --------------------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class VariantRow:
    """One ``variants`` row: q (B, Hq, N, d), k, v (B, Hkv, N, d) and the score options.
    ``base``: the label of the row (same dtype) this one's time is compared with."""
    label: str
    B: int
    Hq: int
    Hkv: int
    N: int
    d: int
    dtype: str
    causal: bool = False
    window: tuple = None
    softcap: float = None
    alibi: bool = False
    base: str = None

    def options(self, slopes=None):
        return {"causal": self.causal, "window": self.window, "softcap": self.softcap,
                "alibi_slopes": slopes if self.alibi else None}


def _variant_rows(dtypes, B, H, N, d, long_n, left):
    rows = []
    for dt in dtypes:
        rows += [VariantRow("mha", B, 2 * H, 2 * H, N, d, dt),
                 VariantRow("gqa 4:1", B, 2 * H, H // 2, N, d, dt, base="mha"),
                 VariantRow("plain", B, H, H, N, d, dt),
                 VariantRow("softcap", B, H, H, N, d, dt, softcap=30.0, base="plain"),
                 VariantRow("alibi", B, H, H, N, d, dt, alibi=True, base="plain"),
                 VariantRow("softcap+alibi", B, H, H, N, d, dt, softcap=30.0, alibi=True, base="plain"),
                 VariantRow("causal", 1, H, H, long_n, d, dt, causal=True),
                 VariantRow(f"window {left}", 1, H, H, long_n, d, dt, causal=True, window=(left, 0), base="causal")]
    return rows


# The issue's targets: GQA (4, 32 -> 8, 4096, 128) within 5% of MHA's TFLOP/s; a causal
# window of 1024 at N = 16384 in <= 0.15x full causal's time; softcap, ALiBi <= 10% slower.
VARIANT_ROWS = _variant_rows(("bfloat16", "float32"), 4, 16, 4096, 128, 16384, 1024)
TINY_VARIANT_ROWS = _variant_rows(("float32", "bfloat16"), 1, 2, 19, 16, 40, 5)
VARIANT_VALIDATE_N = 2048      # validated on the first batch index, N cut to this, two K/V heads


def alibi_slopes(h):
    """The ALiBi paper's slopes for h heads: 2^(-8 i / h), i = 1 .. h."""
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def variant_flops(r: VariantRow) -> float:
    """4·d per visible (query, key) pair per head: the FlashAttention convention for the
    visible area (a causal square is half of N², plus its diagonal)."""
    rules = scores.parse(r.causal, r.window, r.softcap, r.alibi)
    return 4.0 * r.d * r.B * r.Hq * scores.visible_pairs(rules, r.N, r.N)


def variant_inputs(r: VariantRow, bench, n=None, b=None, hq=None):
    n, b, hq = n or r.N, b or r.B, hq or r.Hq
    hk = hq * r.Hkv // r.Hq
    q, k, v = random_arrays([(b, hq, n, r.d), (b, hk, n, r.d), (b, hk, n, r.d)], r.dtype, bench.kind, bench.torch)
    slopes = alibi_slopes(r.Hq)[:hq]
    if bench.kind == "torch":
        slopes = bench.torch.from_numpy(slopes).cuda()
    elif bench.kind == "numba":
        slopes = cuda.to_device(slopes)
    return q, k, v, slopes


def validate_variant(r: VariantRow, bench, backward=True):
    """Ours against the float64 oracle on a cut of the row's problem: batch 0, N at most
    ``VARIANT_VALIDATE_N``, the first two K/V heads and their query heads (same kernels);
    the backward too where the dtype has one, unless ``backward`` is False."""
    g = r.Hq // r.Hkv
    n = min(r.N, VARIANT_VALIDATE_N)
    q, k, v, slopes = variant_inputs(r, bench, n=n, b=1, hq=g * min(2, r.Hkv))
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, **r.options(slopes))
        host = [to_host(x).astype(np.float64) for x in (q, k, v)]
        opts = r.options(to_host(slopes).astype(np.float64))
        ref_out, ref_lse = reference.attention_fwd(*host, **opts)
        err = max(max_abs_err(to_host(out).astype(np.float64), ref_out), max_abs_err(to_host(lse), ref_lse))
        ok = bool(err <= TOLERANCE[r.dtype])
        val = {"valid": ok, "max_abs_err": err, "tolerance": TOLERANCE[r.dtype], "n": n, "error": None}
        if backward and has_backward(r):     # dq, dk, dv: max abs error relative to max(1, max|oracle|)
            dout = random_arrays([tuple(q.shape)], r.dtype, bench.kind, bench.torch, SEED + 1)[0]
            grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **r.options(slopes))
            refs = reference.attention_bwd(to_host(dout).astype(np.float64), *host, **opts)
            bwd = max(max_abs_err(to_host(g), ref) / max(1.0, float(np.abs(ref).max())) for g, ref in zip(grads, refs))
            val.update(bwd_rel_err=bwd, bwd_tolerance=BWD_TOLERANCE[r.dtype])
            val["valid"] = ok and bool(bwd <= BWD_TOLERANCE[r.dtype])
        return val
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"valid": False, "max_abs_err": None, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


def has_backward(r: VariantRow):
    return r.dtype in registry.dtypes("backward")


def time_variant_backward(r: VariantRow, q, k, v, slopes, bench, flops):
    """``attention_bwd`` alone (out and lse from one forward call), as ``time_numba``."""
    opts = r.options(slopes)
    out, lse = numba_flash.attention_fwd(q, k, v, **opts)
    dout = random_arrays([tuple(q.shape)], r.dtype, bench.kind, bench.torch, SEED + 1)[0]
    return time_numba(lambda: numba_flash.attention_bwd(dout, q, k, v, out, lse, **opts), bench,
                      BWD_FLOP_FACTOR * flops, lambda: api.plan_backward(dout, q, k, v, out, lse, **opts))


def variant_peers(r: VariantRow, q, k, v, slopes, torch, flex):
    """{name: call} of the PyTorch peers that compute this row: SDPA (GQA through
    ``enable_gqa``, a window as a boolean ``attn_mask``, ALiBi as a float ``attn_mask``
    bias; softcap it cannot express) and FlexAttention under ``torch.compile`` (``flex``)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    peers = {}
    n = r.N
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    if r.softcap is None:
        if r.window is not None:
            left, right = r.window
            mask = (j <= i + (0 if r.causal else right)) & (j >= i - left)
            peers["sdpa mask"] = lambda: sdpa(q, k, v, attn_mask=mask)
        elif r.alibi:
            bias = (-slopes[:, None, None] * (i - j).abs()).to(q.dtype)[None]
            peers["sdpa bias"] = lambda: sdpa(q, k, v, attn_mask=bias, is_causal=False)
        else:
            peers["sdpa"] = lambda: sdpa(q, k, v, is_causal=r.causal, enable_gqa=r.Hq != r.Hkv)
    if flex is not None:
        fa, create_block_mask = flex
        block_mask = None
        if r.window is not None or r.causal:
            left = None if r.window is None else r.window[0]
            block_mask = create_block_mask(
                lambda b, h, qi, kj: (qi >= kj) & ((qi - kj <= left) if left is not None else (qi >= 0)),
                None, None, n, n)
        cap = r.softcap

        def score_mod(score, b, h, qi, kj):
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if r.alibi:
                score = score - slopes[h] * (qi - kj).abs()
            return score
        mod = score_mod if (cap is not None or r.alibi) else None
        peers["flex"] = lambda: fa(q, k, v, score_mod=mod, block_mask=block_mask, enable_gqa=r.Hq != r.Hkv)
    return peers


def _flex(torch):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        return torch.compile(flex_attention), create_block_mask
    except Exception:  # noqa: BLE001 - an older torch
        return None


def run_variants(args):
    """GQA, sliding window, softcap and ALiBi rows: validated, then timed against the row
    they vary (``base``) and the PyTorch peers that express them."""
    bench = make_bench(args)
    env = environment(bench.torch)
    print(_header(env), flush=True)
    rows_cfg = TINY_VARIANT_ROWS if args.tiny else VARIANT_ROWS
    rows_cfg = [r for r in rows_cfg if r.dtype in args.variant_dtypes]
    flex = _flex(bench.torch) if bench.torch is not None and not args.no_flex else None
    rows, by_label, status = [], {}, 0
    for r in rows_cfg:
        val = validate_variant(r, bench, args.variant_backward)
        rec = {"mode": "variants", "row": dataclasses.asdict(r), "flops": variant_flops(r), "validation": val,
               "valid": val["valid"], "ours": {}, "peers": {}}
        if not val["valid"]:
            status = 1
            print(f"VALIDATION FAILED for {r.label} {r.dtype}: {val.get('error') or val['max_abs_err']}\n"
                  f"{val.get('traceback', '')}", file=sys.stderr, flush=True)
        else:
            q, k, v, slopes = variant_inputs(r, bench)
            opts = r.options(slopes)
            rec["ours"] = time_numba(lambda: numba_flash.attention_fwd(q, k, v, **opts), bench, rec["flops"],
                                     lambda: api.plan_forward(q, k, v, **opts))
            if has_backward(r) and args.variant_backward:
                rec["backward"] = time_variant_backward(r, q, k, v, slopes, bench, rec["flops"])
            base = by_label.get((r.base, r.dtype))
            for key, name in (("ours", "vs_base"), ("backward", "bwd_vs_base")):
                mine, theirs = rec.get(key, {}), (base or {}).get(key, {})
                if mine.get("ms_median") and theirs.get("ms_median"):
                    rec[name] = {"base": r.base, "time_ratio": mine["ms_median"] / theirs["ms_median"],
                                 "tflops_ratio": mine["tflops"] / theirs["tflops"]}
            if bench.torch is not None and bench.peers:
                for name, call in variant_peers(r, q, k, v, slopes, bench.torch, flex).items():
                    try:
                        peer = time_torch(call, bench, rec["flops"])
                    except Exception as exc:  # noqa: BLE001 - unsupported, out of memory, no compiler
                        peer = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                    peer["ratio"] = ratio(rec["ours"], peer)
                    rec["peers"][name] = peer
                    bench.torch.cuda.empty_cache()
            del q, k, v
        by_label[(r.label, r.dtype)] = rec
        rows.append(rec)
        print(f"  {variant_line(rec)}", flush=True)
    doc = {"mode": "variants", **env, "settings": _settings(args, bench), "rows": rows}
    write_json(args.json, doc)
    table = "\n".join([VARIANT_HEADER, "-" * len(VARIANT_HEADER)] + [variant_line(r) for r in rows])
    if args.markdown:
        Path(args.markdown).write_text(render_variants_markdown(doc))
    print(f"Wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))
    print()
    print(table)
    print("TFLOP/s count 4·d per visible (query, key) pair. vs base: ours ms ÷ the base row's ms (same dtype). "
          "ratio: ours TFLOP/s ÷ the peer's. sdpa mask / sdpa bias: SDPA with an explicit attn_mask; flex: "
          "FlexAttention under torch.compile.")
    return status


VARIANT_HEADER = (f"{'row':>14} {'dtype':>8} {'shape (B,Hq/Hkv,N,d)':>22} {'ours ms':>8} {'TF/s':>7} "
                  f"{'vs base':>14} {'valid':>7}  peers (TF/s, ours/peer)")


def variant_line(rec):
    r, o = rec["row"], rec["ours"]
    shape = f"({r['B']},{r['Hq']}/{r['Hkv']},{r['N']},{r['d']})"
    vb = rec.get("vs_base")
    vs = f"{vb['time_ratio']:.3f}x {vb['base']}" if vb else "—"
    bw = rec.get("backward") or {}
    bvb = rec.get("bwd_vs_base")
    bwd = (f"  bwd {_fmt(bw.get('ms_median'), '.3f')} ms {_fmt(bw.get('tflops'), '.1f')} TF/s"
           + (f" ({bvb['time_ratio']:.3f}x)" if bvb else "")) if bw else ""
    peers = "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                      + (f" [{p['error'][:60]}]" if p.get("error") else "") for n, p in rec["peers"].items())
    return (f"{r['label']:>14} {r['dtype']:>8} {shape:>22} {_fmt(o.get('ms_median'), '.3f'):>8} "
            f"{_fmt(o.get('tflops'), '.1f'):>7} {vs:>14} {'ok' if rec['valid'] else 'INVALID':>7}  {peers}{bwd}")


def render_variants_markdown(doc):
    lines = [f"**variants** · {doc['date']} · {doc['gpu']['name']} · git `{(doc['git_sha'] or '?')[:12]}`", "",
             "| row | dtype | shape (B,Hq/Hkv,N,d) | ours ms | kernels ms | ours TFLOP/s | vs base (time) "
             "| peers: TFLOP/s (ours/peer) | backward ms | bwd vs base |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for rec in doc["rows"]:
        r, o, vb = rec["row"], rec["ours"], rec.get("vs_base")
        vs = "—" if not vb else f"{vb['time_ratio']:.3f}× {vb['base']}"
        bb = rec.get("bwd_vs_base")
        peers = "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                          for n, p in rec["peers"].items() if not p.get("error")) or "—"
        lines.append(f"| {r['label']} | {r['dtype']} | ({r['B']},{r['Hq']}/{r['Hkv']},{r['N']},{r['d']}) | "
                     f"{_fmt(o.get('ms_median'), '.3f')} | {_fmt(o.get('kernel_ms_median'), '.3f')} | "
                     f"{_fmt(o.get('tflops'), '.1f')} | {vs} | {peers} | "
                     f"{_fmt(rec.get('backward', {}).get('ms_median'), '.3f')} | "
                     f"{'—' if not bb else format(bb['time_ratio'], '.3f') + '×'} |")
    return "\n".join(lines) + "\n"


def variants_options(p):
    p.add_argument("--variant-dtypes", type=_csv_choice(("float32", "bfloat16")), default=["bfloat16", "float32"],
                   help="dtypes of the variants rows (default: bfloat16,float32)")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (torch.compile)")
    p.add_argument("--no-backward", dest="variant_backward", action="store_false",
                   help="skip timing attention_bwd on the rows whose dtype has a backward")


# --------------------------------------------------------------------------- serving mode
@dataclasses.dataclass(frozen=True)
class ServingRow:
    """One serving problem. ``kind``: "kvcache" (``attention_with_kvcache``, one new query
    per sequence, the (B, N, H, d) cache layout), "paged" (the same through a paged cache of
    ``page`` rows a page, its pages in shuffled order), "decode" (``attention`` with ``Nq = 1``
    in the (B, H, N, d) layout), "varlen" (``attention_varlen``, causal prefill of
    sequences of ``lens``) or "padded" (the same sequences padded to the longest, one
    ``attention`` call)."""
    label: str
    kind: str
    B: int
    Hq: int
    Hkv: int
    Nk: int
    d: int
    dtype: str
    lens: tuple = ()
    page: int = 0


def _serving_rows(B, Hq, N, d, lens, dtypes, pages=(16, 256)):
    rows = []
    for dt in dtypes:
        rows += [ServingRow("kvcache", "kvcache", B, Hq, Hq, N, d, dt)]
        rows += [ServingRow(f"paged {p}", "paged", B, Hq, Hq, N, d, dt, page=p) for p in pages]
        rows += [ServingRow("kvcache gqa", "kvcache", B, Hq, Hq // 4, N, d, dt),
                 ServingRow("decode", "decode", B, Hq, Hq, N, d, dt),
                 ServingRow("varlen", "varlen", len(lens), Hq // 2, Hq // 2, max(lens), d, dt, tuple(lens)),
                 ServingRow("padded", "padded", len(lens), Hq // 2, Hq // 2, max(lens), d, dt, tuple(lens))]
    return rows


# The issue's targets: decode bf16 (B=16, Hq=32, Nk=8192, d=128) >= 0.9x SDPA and >= 3.5 TB/s of
# K/V read; with GQA (Hkv=8) K/V read once per group; varlen prefill (16 sequences of 256..4096,
# causal) within 10% of the padded batch's TFLOP/s and faster than it in time.
SERVING_ROWS = _serving_rows(16, 32, 8192, 128, tuple(int(x) for x in np.linspace(256, 4096, 16)),
                             ("bfloat16", "float32"))
TINY_SERVING_ROWS = _serving_rows(2, 4, 40, 16, (5, 17, 33), ("bfloat16", "float32"), pages=(8,))
SERVING_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}


def serving_flops(r: ServingRow) -> float:
    """4·d per visible (query, key) pair per head; "padded" counts its padded problem."""
    if r.kind in ("kvcache", "paged", "decode"):
        return 4.0 * r.d * r.B * r.Hq * r.Nk
    rules = scores.parse(True)
    lens = (r.Nk,) * len(r.lens) if r.kind == "padded" else r.lens
    return 4.0 * r.d * r.Hq * sum(scores.visible_pairs(rules, n, n) for n in lens)


def serving_bytes(r: ServingRow) -> float:
    """Bytes of K and V a decode row must read (once per K/V head)."""
    return 2.0 * r.B * r.Nk * r.Hkv * r.d * NP_DTYPES[r.dtype].itemsize


def _oracle_err(got, q, k, v, causal):
    """Max abs error of ``got (Hq, n, d)`` against the float64 oracle (K/V heads repeated)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
    return max_abs_err(got, reference.attention(q, k, v, causal=causal))


def serving_inputs(r: ServingRow, bench):
    """``(call, peer_calls, check)``: ours, the SDPA calls of the same problem (PyTorch
    inputs only) and ``check()`` -> ours' max abs error against the float64 oracle on
    sequence 0 (its first 256 queries for the padded batch)."""
    kind, torch = bench.kind, bench.torch
    sdpa = None if kind != "torch" else torch.nn.functional.scaled_dot_product_attention
    peers = {}
    if r.kind in ("kvcache", "paged", "decode"):
        gqa = r.Hkv != r.Hq
        if r.kind == "paged":
            n_pages = r.B * r.Nk // r.page
            q, kp, vp = random_arrays([(r.B, 1, r.Hq, r.d), (n_pages, r.page, r.Hkv, r.d),
                                       (n_pages, r.page, r.Hkv, r.d)], r.dtype, kind, torch)
            order = np.random.default_rng(SEED).permutation(n_pages).astype(np.int32).reshape(r.B, -1)
            table = torch.tensor(order, device="cuda") if kind == "torch" else (
                order if kind == "numpy" else cuda.to_device(order))
            lens = np.full(r.B, r.Nk, np.int32)
            call = lambda: numba_flash.attention_with_kvcache(q, kp, vp, lens, block_table=table)  # noqa: E731
            heads_first = lambda x: np.swapaxes(x, 0, 1)  # noqa: E731
            # the contiguous cache of the same rows (sequence b's row j: page order[b, j // page])
            flat = order.reshape(-1)
            gather = {"torch": lambda x: x[torch.as_tensor(flat.astype(np.int64), device=x.device)],
                      "numpy": lambda x: x[flat],
                      "numba": lambda x: cuda.to_device(to_host(x)[flat])}[kind]
            kc, vc = (gather(x).reshape(r.B, r.Nk, r.Hkv, r.d) for x in (kp, vp))
            if sdpa:
                tq, tk, tv = (x.transpose(1, 2) for x in (q, kc, vc))
        elif r.kind == "kvcache":
            q, kc, vc = random_arrays([(r.B, 1, r.Hq, r.d), (r.B, r.Nk, r.Hkv, r.d), (r.B, r.Nk, r.Hkv, r.d)],
                                      r.dtype, kind, torch)
            lens = np.full(r.B, r.Nk, np.int32)
            call = lambda: numba_flash.attention_with_kvcache(q, kc, vc, lens)  # noqa: E731
            heads_first = lambda x: np.swapaxes(x, 0, 1)  # noqa: E731
            if sdpa:
                tq, tk, tv = (x.transpose(1, 2) for x in (q, kc, vc))
        else:
            q, kc, vc = random_arrays([(r.B, r.Hq, 1, r.d), (r.B, r.Hkv, r.Nk, r.d), (r.B, r.Hkv, r.Nk, r.d)],
                                      r.dtype, kind, torch)
            call = lambda: numba_flash.attention(q, kc, vc)  # noqa: E731
            heads_first = lambda x: x  # noqa: E731
            tq, tk, tv = q, kc, vc
        if sdpa:
            peers = {name: lambda: sdpa(tq, tk, tv, enable_gqa=gqa) for name in PEERS}
        q0, k0, v0 = (heads_first(to_host(x)[0]) for x in (q, kc, vc))
        return call, peers, lambda: _oracle_err(heads_first(to_host(call())[0]), q0, k0, v0, False)
    if r.kind == "varlen":
        lens = np.asarray(r.lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v = random_arrays([(int(cu[-1]), r.Hq, r.d)] * 3, r.dtype, kind, torch)
        call = lambda: numba_flash.attention_varlen(q, k, v, cu, cu, causal=True)  # noqa: E731
        n0 = int(lens[0])
        q0, k0, v0 = (np.swapaxes(to_host(x)[:n0], 0, 1) for x in (q, k, v))
        return call, peers, lambda: _oracle_err(np.swapaxes(to_host(call())[:n0], 0, 1), q0, k0, v0, True)
    q, k, v = random_arrays([(r.B, r.Hq, r.Nk, r.d)] * 3, r.dtype, kind, torch)
    call = lambda: numba_flash.attention(q, k, v, causal=True)  # noqa: E731
    if sdpa:
        peers = {name: lambda: sdpa(q, k, v, is_causal=True) for name in PEERS}
    n0 = min(256, r.Nk)
    q0, k0, v0 = (to_host(x)[0, :, :n0] for x in (q, k, v))
    return call, peers, lambda: _oracle_err(to_host(call())[0, :, :n0], q0, k0, v0, True)


def run_serving(args):
    """Decoding against KV caches, and a packed variable-length prefill against its padded
    batch: validated on sequence 0, then timed against SDPA."""
    bench = make_bench(args)
    env = environment(bench.torch)
    print(_header(env), flush=True)
    rows_cfg = [r for r in (TINY_SERVING_ROWS if args.tiny else SERVING_ROWS)
                if r.dtype in args.serving_dtypes and r.kind in args.serving_kinds]
    rows, status, varlen, contiguous = [], 0, {}, {}
    for r in rows_cfg:
        rec = {"mode": "serving", "row": dataclasses.asdict(r), "flops": serving_flops(r), "ours": {}, "peers": {}}
        try:
            call, peers, check = serving_inputs(r, bench)
            rec["max_abs_err"] = check()
            rec["valid"] = bool(rec["max_abs_err"] <= SERVING_TOLERANCE[r.dtype])
        except Exception as exc:  # noqa: BLE001 - reported in the row
            rec.update(valid=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        if not rec["valid"]:
            status = 1
            print(f"VALIDATION FAILED for {r.label} {r.dtype}: {rec.get('error') or rec['max_abs_err']}\n"
                  f"{rec.get('traceback', '')}", file=sys.stderr, flush=True)
        else:
            rec["ours"] = time_numba(call, bench, rec["flops"])
            if r.kind in ("kvcache", "paged", "decode") and rec["ours"].get("ms_median"):
                rec["ours"]["tb_per_s"] = serving_bytes(r) / (rec["ours"]["ms_median"] * 1e-3) / 1e12
            for name, peer_call in peers.items():
                if r.dtype in PEER_DTYPES[name] and bench.peers:
                    peer = run_peer(name, bench, lambda: time_torch(peer_call, bench, rec["flops"]))
                    peer["ratio"] = ratio(rec["ours"], peer)
                    rec["peers"][name] = peer
            if r.kind == "varlen":
                varlen[r.dtype] = rec
            if r.kind == "kvcache" and r.Hkv == r.Hq:
                contiguous[r.dtype] = rec["ours"]
            base = contiguous.get(r.dtype, {}).get("ms_median")
            if r.kind == "paged" and base and rec["ours"].get("ms_median"):
                rec["vs_contiguous"] = {"time_ratio": rec["ours"]["ms_median"] / base}
            mine = varlen.get(r.dtype, {}).get("ours", {})
            if r.kind == "padded" and mine.get("ms_median") and rec["ours"].get("ms_median"):
                varlen[r.dtype]["vs_padded"] = {"time_ratio": mine["ms_median"] / rec["ours"]["ms_median"],
                                                "tflops_ratio": mine["tflops"] / rec["ours"]["tflops"]}
        rows.append(rec)
        print(f"  {serving_line(rec)}", flush=True)
    doc = {"mode": "serving", **env, "settings": _settings(args, bench), "rows": rows}
    write_json(args.json, doc)
    print(f"Wrote {args.json}\n")
    print("\n".join([SERVING_HEADER, "-" * len(SERVING_HEADER)] + [serving_line(r) for r in rows]))
    print("TFLOP/s: 4·d per visible (query, key) pair (padded: of its padded problem). TB/s: K and V bytes read "
          "once per K/V head ÷ time. varlen vs padded: time ratio and TFLOP/s ratio; paged vs contiguous: time ratio. peers: TFLOP/s (ours/peer).")
    return status


SERVING_HEADER = (f"{'row':>12} {'dtype':>8} {'B,Hq/Hkv,Nk,d':>18} {'ours ms':>8} {'TF/s':>7} {'TB/s':>6} "
                  f"{'valid':>7}  peers; vs padded or contiguous")


def serving_line(rec):
    r, o = rec["row"], rec["ours"]
    shape = f"{r['B']},{r['Hq']}/{r['Hkv']},{r['Nk']},{r['d']}"
    peers = "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                      + (f" [{p['error'][:50]}]" if p.get("error") else "") for n, p in rec["peers"].items())
    vp = rec.get("vs_padded")
    extra = f"vs padded: {vp['time_ratio']:.3f}x time, {vp['tflops_ratio']:.3f}x TF/s" if vp else ""
    if rec.get("vs_contiguous"):
        extra = f"vs contiguous cache: {rec['vs_contiguous']['time_ratio']:.3f}x time"
    return (f"{r['label']:>12} {r['dtype']:>8} {shape:>18} {_fmt(o.get('ms_median'), '.3f'):>8} "
            f"{_fmt(o.get('tflops'), '.1f'):>7} {_fmt(o.get('tb_per_s'), '.2f'):>6} "
            f"{'ok' if rec.get('valid') else 'INVALID':>7}  {peers}{extra}")


def serving_options(p):
    p.add_argument("--serving-dtypes", type=_csv_choice(("float32", "bfloat16")), default=["bfloat16", "float32"],
                   help="dtypes of the serving rows (default: bfloat16,float32)")
    kinds = ("kvcache", "paged", "decode", "varlen", "padded")
    p.add_argument("--serving-kinds", type=_csv_choice(kinds), default=list(kinds),
                   help=f"kinds of serving rows (default: {','.join(kinds)})")


# --------------------------------------------------------------------------- command line
def _csv_choice(choices):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"got {text!r}; choose a comma-separated subset of {', '.join(choices)}")
        return items
    return parse


def _common_options(p=None):
    """Options every mode takes: added to ``p`` (a parser or an argument group), or to a new
    parent parser."""
    p = p if p is not None else argparse.ArgumentParser(add_help=False)
    p.add_argument("--shapes", type=_csv_choice([k for k in SHAPE_SETS if k != "tiny"]),
                   default=list(DEFAULT_SHAPES),
                   help=f"shape sets, comma-separated (default: {','.join(DEFAULT_SHAPES)})")
    dtypes = registry.dtypes("forward")
    p.add_argument("--dtype", type=_csv_choice(dtypes), default=["float32"],
                   help="dtypes, comma-separated, from " + ", ".join(dtypes) + " (default: float32)")
    p.add_argument("--quick", action="store_true", help="only " + ", ".join(map(str, QUICK_SHAPES)))
    p.add_argument("--tiny", action="store_true",
                   help="simulator-sized shapes, few repeats: a smoke test (works without a GPU)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"minimum timed repeats (default {DEFAULT_REPEATS}; {TINY_REPEATS} with --tiny)")
    p.add_argument("--min-time", type=float, default=None,
                   help=f"minimum total timed seconds per row (default {DEFAULT_MIN_TIME_S:g}; 0 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default {DEFAULT_WARMUP}; with --tiny 1, or 0 in the simulator)")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch SDPA peers")
    p.add_argument("--no-flush-l2", action="store_true", help="do not overwrite L2 between repeats")
    p.add_argument("--json", default=None, help="JSON output (default: results/bench-<mode>.json)")
    p.add_argument("--markdown", default=None, help="also write the table as a Markdown fragment here")
    return p


@dataclasses.dataclass(frozen=True)
class Mode:
    help: str
    run: object   # args -> exit status
    options: object = None   # parser -> None: adds the mode's own options


MODES = {
    "forward": Mode("fused forward vs PyTorch SDPA (default)", run_forward),
    "backward": Mode("attention_bwd (dq, dk, dv) vs PyTorch SDPA backward", run_backward),
    "ladder": Mode("the kernel ladder (numba_flash.ladder): the seed's Results table, rung by rung",
                   run_ladder, ladder_options),
    "variants": Mode("GQA, sliding window, softcap, ALiBi: vs the plain call and PyTorch's SDPA / FlexAttention",
                     run_variants, variants_options),
    "serving": Mode("decoding against KV caches, packed variable-length prefill: vs SDPA and the padded batch",
                    run_serving, serving_options),
}
DEFAULT_MODE = "forward"
NO_GPU = ("bench.py times kernels with CUDA events, so it needs a CUDA GPU, and none was found "
          "(kernels would run in Numba's CUDA simulator, where the default shapes take hours and "
          "times mean nothing). Without a GPU, run the smoke test instead: tiny shapes in the "
          "simulator, validated against the oracle, then timed (meaningless times):\n    python bench.py --tiny\n"
          "    python bench.py backward --tiny\n    python bench.py ladder --tiny")


def _all_options_help():
    """Every mode's options, for the top-level ``--help`` (argparse lists a sub-command's
    options only under ``bench.py MODE --help``)."""
    shown = argparse.ArgumentParser(prog="bench.py", add_help=False, usage=argparse.SUPPRESS)
    _common_options(shown.add_argument_group(f"options of every mode ({', '.join(MODES)})"))
    for name, mode in MODES.items():
        if mode.options is not None:
            mode.options(shown.add_argument_group(f"{name} options"))
    return shown.format_help().strip()


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in MODES and argv[0] not in ("-h", "--help")):
        argv.insert(0, DEFAULT_MODE)
    usage = __doc__.split("\n\n")[1]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + usage
        + "\n\nWithout a GPU only --tiny runs (a smoke test in the simulator).",
        epilog=_all_options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", metavar="MODE", help=f"default: {DEFAULT_MODE}")
    common = _common_options()
    for name, mode in MODES.items():
        sp = sub.add_parser(name, parents=[common], help=mode.help)
        sp.set_defaults(run=mode.run)
        if mode.options is not None:
            mode.options(sp)
    args = parser.parse_args(argv)
    args.argv = argv
    tiny = args.tiny
    args.repeats = args.repeats if args.repeats is not None else (TINY_REPEATS if tiny else DEFAULT_REPEATS)
    args.min_time = args.min_time if args.min_time is not None else (0.0 if tiny else DEFAULT_MIN_TIME_S)
    # --tiny in the simulator: no warm-up (there is no JIT to keep out of the times, which mean nothing there)
    args.warmup = args.warmup if args.warmup is not None else (
        (0 if SIMULATOR else 1) if tiny else DEFAULT_WARMUP)
    args.json = args.json or str(ROOT / "results" / f"bench-{args.mode}.json")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if SIMULATOR and not args.tiny:
        print(NO_GPU, file=sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
