"""What every mode measures with: configurations and their FLOPs, inputs, validation against
the float64 oracle, timing (CUDA events, L2 flush, warm-up, medians) and peak device memory."""
import dataclasses
import gc
import math
import time

import ml_dtypes
import numpy as np

from numba_flash import SIMULATOR, _arrays, reference, scores  # first: decides GPU vs simulator
from numba_flash.launch import launch

from numba import cuda  # noqa: E402  (after numba_flash, see above)


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
    # head dims the Hopper family runs on a padded kernel (72 and 136, the most padded of
    # its d = 128 and 256 kernels, and 96) or its widest (256), to time it against the
    # mma.sync family (NUMBA_FLASH_HOPPER=0) and the peers
    "head_dims": [Shape(TOKENS // n, HIDDEN // d, n, n, d) for d in (72, 96, 136, 256) for n in (1024, 4096)],
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
L2_FLUSH_BYTES = 256 << 20   # read between repeats: > 4x the H200's 60 MB L2
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}

# Backward mode
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


FLUSH_SIGNATURE = "void(uint64[::1], uint64[::1])"
FLUSH_GRID = (1024, 256)


def read_all(buf, sink):
    """Read every word of ``buf`` (the L2 flush's kernel). The XOR of the words decides a
    store that never happens (the buffer holds zeros), so the loads cannot be dropped."""
    acc = np.uint64(0)
    for j in range(cuda.grid(1), buf.size, cuda.gridsize(1)):
        acc ^= buf[j]
    if acc == np.uint64(1):
        sink[0] = acc


def make_l2_flush():
    """A callable that evicts the L2 cache (None in the simulator): a kernel reads a
    ``L2_FLUSH_BYTES`` buffer, more than four times L2. Read, not written: a written flush
    (a memset) leaves L2 full of dirty lines, and their write-back then lands inside the
    next timed call, costing a short call tens of microseconds that are not its own
    (docs/performance.md item 89). What the timed call finds is the same either way: none
    of its inputs in L2."""
    if SIMULATOR:
        return None
    buf = cuda.device_array(L2_FLUSH_BYTES // 8, dtype=np.uint64)
    cuda.cudadrv.driver.device_memset(buf, 0, buf.nbytes)
    sink = cuda.device_array(1, dtype=np.uint64)
    kernel = cuda.jit(FLUSH_SIGNATURE)(read_all)
    blocks, threads = FLUSH_GRID
    return lambda: kernel[blocks, threads](buf, sink)


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


def spec_record(spec, s: Shape, rows):
    """A kernel specialisation as the JSON records it; ``rows`` is what its grid's x axis tiles."""
    t = spec.tiling
    return {"kernel": spec.name, "variant": spec.variant, "use_async": spec.use_async,
            "tiling": dataclasses.asdict(t), "BM": t.BM, "BN": t.BN, "threads": t.threads,
            "smem_bytes": spec.smem_bytes,
            "grid": [-(-rows // t.BM) * s.B * s.H, -(-s.d // t.DO)]}


def measure_back_to_back(call, events, bench, calls=20, runs=5):
    """Milliseconds per call of ``calls`` calls issued back to back, with no
    synchronisation or L2 flush between them: what a loop of calls sees (a model's layers
    in one decoding step), where each call's host work overlaps the kernels queued before
    it, while :func:`measure` shows one call's latency, host work included. Median of
    ``runs`` runs (their outputs kept alive until each run's end)."""
    for _ in range(bench.warmup):
        call()
    per_call = []
    for _ in range(runs):
        release_pending_frees()
        events.synchronize()
        ms, _ = events.time(lambda: [call() for _ in range(calls)])
        per_call.append(ms / calls)
    return float(np.median(per_call))


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


