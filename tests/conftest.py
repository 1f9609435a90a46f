"""Shared test configuration: Hypothesis profiles, warning filters, the NaN poison, helpers.

Profiles (``HYPOTHESIS_PROFILE`` picks one; ``ci`` is the default):

* ``ci``: derandomized (the same examples every run, whatever the machine), no deadline,
  12 examples per property test in the simulator (40 on a GPU) on top of its pinned
  ``@example`` edge cases: the quick default, which keeps the suite within about 5
  minutes on a 2-core machine without a GPU.
* ``thorough``: random, 200 examples per property test (an hour or more in the
  simulator); run it before a release or after changing a kernel.
* ``gpu``: random, no deadline, 150 examples; for a machine with a CUDA GPU.

``ON_GPU`` is True when kernels run on a real GPU rather than in Numba's CUDA
simulator; tests use it to choose problem sizes.
"""
import dataclasses
import importlib
import math
import os
import warnings

# numba_flash warns once, at import, when it switches the simulator on.
warnings.filterwarnings("ignore", message="numba_flash: no CUDA GPU found")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import numba_flash  # noqa: E402
import numba_flash.api  # noqa: E402
from numba_flash import reference  # noqa: E402
from numba_flash import scores  # noqa: E402
from numba_flash.scores import visible_mask  # noqa: E402

ON_GPU = not numba_flash.SIMULATOR

# Subprocesses (examples, bench.py, PTX compiles) are killed after this long: a guard
# against a hang, not a time budget (a slow or busy machine must not fail a test).
HANG_GUARD_S = 3600
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_env(**overrides):
    """``os.environ`` with the project's root first on PYTHONPATH, for subprocesses that run
    its code as a user would; ``NAME=None`` removes a variable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def start_ptx_compile(args, env):
    """``python -m numba_flash.ptx *args`` in the background at a lower priority, so the
    compiles use the CPU that the simulator tests leave idle (collected with communicate())."""
    import subprocess
    import sys
    nice = (lambda: os.nice(10)) if hasattr(os, "nice") else None
    return subprocess.Popen([sys.executable, "-m", "numba_flash.ptx", *args], cwd=ROOT, env=env, preexec_fn=nice,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

_QUIET = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, max_examples=40 if ON_GPU else 12, **_QUIET)
settings.register_profile("thorough", max_examples=200, **_QUIET)
settings.register_profile("gpu", max_examples=150, **_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# numba's performance warning lives in numba.core.errors; numba-cuda has its own class.
_PERF_WARNING_MODULES = ("numba.core.errors", "numba.cuda.core.errors", "numba.cuda.errors")
_PERF_WARNINGS = []
for _mod in _PERF_WARNING_MODULES:
    try:
        _cls = getattr(importlib.import_module(_mod), "NumbaPerformanceWarning", None)
    except ImportError:
        _cls = None
    if _cls is not None and _cls not in _PERF_WARNINGS:
        _PERF_WARNINGS.append(_cls)
        warnings.filterwarnings("ignore", category=_cls)
warnings.filterwarnings("ignore", category=numba_flash.SimulatorWarning)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore::numba_flash.SimulatorWarning")
    for cls in _PERF_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore::{cls.__module__}.{cls.__qualname__}")


# Test modules whose offline compiles run in the background (each has start_runs/stop_runs).
_BACKGROUND_COMPILES = ("test_ptx", "test_ladder")


def pytest_collection_finish(session):
    """Start the slow PTX compiles of test_ptx.py and test_ladder.py in the background right
    away, if those modules were selected: they use the CPU that the single-threaded simulator
    tests leave idle."""
    if session.config.option.collectonly:
        return
    started = set()
    for item in session.items:
        mod = getattr(item, "module", None)
        name = getattr(mod, "__name__", None)
        if name in _BACKGROUND_COMPILES and name not in started and hasattr(mod, "start_runs"):
            mod.start_runs()
            started.add(name)


def pytest_sessionfinish(session):
    import sys
    for name in _BACKGROUND_COMPILES:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "stop_runs"):
            mod.stop_runs()


def pytest_report_header(config):
    return (f"numba_flash: {'GPU' if ON_GPU else 'CUDA simulator'}; "
            f"hypothesis profile {settings._current_profile}")


@pytest.fixture(autouse=True)
def poison_outputs():
    """Fill kernel outputs with NaN before each launch, so unwritten elements fail."""
    previous = numba_flash.api._POISON
    numba_flash.api._POISON = np.nan
    yield
    numba_flash.api._POISON = previous


@pytest.fixture
def on_gpu():
    return ON_GPU


# --------------------------------------------------------------------------- helpers
def np_dtype(name):
    """NumPy dtype of a dtype name, bfloat16 included (``ml_dtypes.bfloat16``)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_qkv(seed, lead, nq, nk, d, dtype, magnitude=1.0):
    """Standard-normal q (lead + (nq, d)), k, v (lead + (nk, d)) times ``magnitude``, in ``dtype``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(tuple(lead) + (nq, d)) * magnitude
    k = rng.standard_normal(tuple(lead) + (nk, d)) * magnitude
    v = rng.standard_normal(tuple(lead) + (nk, d)) * magnitude
    return tuple(x.astype(np_dtype(dtype)) for x in (q, k, v))


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem of the property tests (inputs drawn by ``make_qkv``)."""
    lead: tuple
    nq: int
    nk: int
    d: int
    dtype: str = "float32"
    causal: bool = False
    scale: float = None
    magnitude: float = 1.0
    seed: int = 0
    device: bool = False     # also run with Numba device arrays in and out

    def inputs(self):
        return make_qkv(self.seed, self.lead, self.nq, self.nk, self.d, self.dtype, self.magnitude)


SCORE_OPTIONS = ("causal", "window", "softcap", "alibi_slopes")


def score_options(options):
    """The score options that a helper's ``causal`` argument stands for, as a dict of all four
    :data:`SCORE_OPTIONS` (keyword arguments of the API and of the oracle).

    ``options`` is a bool (the causal mask alone) or a dict with any of ``causal``,
    ``window``, ``softcap`` and ``alibi_slopes`` (device slopes are copied to the host).
    """
    found = dict.fromkeys(SCORE_OPTIONS)
    found["causal"] = False
    if isinstance(options, dict):
        unknown = set(options) - set(SCORE_OPTIONS)
        assert not unknown, f"unknown score options {sorted(unknown)}"
        found.update(options)
    else:
        found["causal"] = options
    slopes = found["alibi_slopes"]
    if slopes is not None and not isinstance(slopes, np.ndarray):
        found["alibi_slopes"] = slopes.copy_to_host()
    return found


def score_rules(options):
    """``(rules, slopes)``: the :class:`numba_flash.scores.Scores` of ``options`` (a bool or a
    dict, see :func:`score_options`) and the ALiBi slopes as a NumPy array (or None)."""
    o = score_options(options)
    slopes = o["alibi_slopes"]
    return scores.parse(o["causal"], o["window"], o["softcap"], slopes is not None), slopes


def expand_heads(q, *arrays):
    """``arrays`` (shaped like k) with their heads (axis -3) repeated to q's, as grouped-query
    attention reads them (query head ``h`` reads K/V head ``h // (Hq // Hkv)``)."""
    out = []
    for x in arrays:
        if x.shape[:-2] != q.shape[:-2]:
            x = np.repeat(x, q.shape[-3] // x.shape[-3], axis=-3)
        out.append(x)
    return out


def alibi_bias(rules, slopes, lead, nq, nk, rows=None):
    """ALiBi's ``slope · |i + Nk − Nq − j|`` (subtracted from the scores) in float64, shape
    ``lead + (len(rows), nk)`` (``rows``: the query rows, all by default), or None
    without ALiBi."""
    if not rules.alibi:
        return None
    rows = np.arange(nq) if rows is None else np.asarray(rows)
    dist = np.abs(rows[:, None] + (nk - nq) - np.arange(nk)[None, :]).astype(np.float64)
    return np.broadcast_to(np.asarray(slopes, np.float64), lead)[..., None, None] * dist


def scores32(q32, k32, causal, scale):
    """The float32 scores of a plain float32 program: ``(s, grad)`` with ``s`` the scaled
    scores after softcap and ALiBi (:func:`numba_flash.scores.transform`, in float32), -inf
    where the mask hides a key, and ``grad`` the softcap's derivative. ``causal``: a bool or
    a dict of score options (:func:`score_options`); k's heads may be fewer than q's (GQA)."""
    rules, slopes = score_rules(causal)
    (k32,) = expand_heads(q32, k32)
    d = q32.shape[-1]
    sc = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    s = np.matmul(q32, np.swapaxes(k32, -1, -2)) * sc
    s, grad = scores.transform(rules, s, slopes)
    s = np.where(visible_mask(rules, s.shape[-2], s.shape[-1]), s, np.float32(-np.inf))
    assert s.dtype == np.float32 and grad.dtype == np.float32
    return s, grad


def softmax32(q32, k32, causal, scale):
    """Plain float32 softmax of the scaled scores: ``(p, m, l, visible)``, with ``m`` the
    row max, ``l`` the row sum of ``exp(s - m)`` and rows that see no key giving p = 0.
    ``causal``: a bool or a dict of score options (:func:`score_options`)."""
    s, _ = scores32(q32, k32, causal, scale)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, np.float32(0))
    e = np.exp(s - m)
    l = np.sum(e, axis=-1, keepdims=True)
    visible = l > 0
    return e / np.where(visible, l, np.float32(1)), m, l, visible


def baseline_fwd32(q, k, v, causal, scale):
    """Plain float32 NumPy attention: what an ordinary float32 implementation gets.

    Returns (out, lse) in float32; rows that see no key get out = 0, lse = -inf.
    ``causal``: a bool or a dict of score options (:func:`score_options`).
    """
    q32, k32, v32 = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    p, m, l, visible = softmax32(q32, k32, causal, scale)
    (v32,) = expand_heads(q32, v32)
    out = np.matmul(p, v32)
    log_l = np.log(l, out=np.full_like(l, -np.inf), where=visible)
    lse = (m + log_l)[..., 0]
    assert out.dtype == np.float32 and lse.dtype == np.float32
    return out, lse


def _max_abs(x):
    return float(np.max(np.abs(x), initial=0.0))


U32, U64 = 2.0**-24, 2.0**-53   # unit roundoff
SLACK_ULPS = 8                  # allowed logit rounding, in units of U · scale · sum|q_c k_c|


def rounding_sensitivity(q, k, v, causal, scale, ref_out, ref_lse):
    """First-order size of the changes in out and lse caused by rounding the logits.

    If each logit s_ij = scale · q_i · k_j is computed with an error of at most
    U · A_ij, where A_ij = scale · sum_c |q_ic k_jc| (a rounding-error bound of the
    dot product, up to a small factor), then to first order out_ic moves by at most
    U · sum_j p_ij A_ij |v_jc - out_ic| and lse_i by at most U · sum_j p_ij A_ij.
    Returns the maxima of these two sums without the factor U. This is how sensitive
    the problem itself is, whatever computes it: two correct float32 programs can
    differ by this much, while a real bug (a wrong mask, a wrong tile) errs by O(|v|).

    ``causal`` is a bool or a dict of score options (:func:`score_options`); k, v may
    have fewer heads than q (GQA). The other score rules change A_ij: with a softcap
    ``c`` (``t = tanh(s_ij / c)``) the dot product's error reaches the capped score times
    ``1 - t²``, and the capped score ``c · t`` is itself rounded, so A_ij becomes
    ``(1 - t²) · scale · sum_c |q_ic k_jc| + |c · t|`` (at most twice the plain bound);
    ALiBi adds the bias ``|slope · (i + Nk - Nq - j)|``, since the biased score is what a
    float32 program rounds.
    """
    rules, slopes = score_rules(causal)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = expand_heads(q, k, v)
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if q.size == 0 or nk == 0:
        return 0.0, 0.0
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q3, k3, v3 = q.reshape(-1, nq, d), k.reshape(-1, nk, d), v.reshape(-1, nk, d)
    o3, l3 = np.asarray(ref_out).reshape(-1, nq, d), np.asarray(ref_lse).reshape(-1, nq)
    slopes3 = np.broadcast_to(np.asarray(slopes, np.float64), q.shape[:-2]).reshape(-1) if rules.alibi else None
    mask = visible_mask(rules, nq, nk)
    rows = max(1, (1 << 22) // (nk * d))
    s_out = s_lse = 0.0
    for b in range(q3.shape[0]):
        for r0 in range(0, nq, rows):
            r1 = min(nq, r0 + rows)
            qi, lse = q3[b, r0:r1], l3[b, r0:r1, None]
            s = sc * (qi @ k3[b].T)
            a = sc * (np.abs(qi) @ np.abs(k3[b]).T)
            if rules.softcap is not None:
                t = np.tanh(s / rules.softcap)
                s = rules.softcap * t
                a = (1 - t * t) * a + np.abs(s)
            if rules.alibi:
                bias = alibi_bias(rules, slopes3[b], (), nq, nk, np.arange(r0, r1))
                s = s - bias
                a = a + np.abs(bias)
            vis = mask[r0:r1] & np.isfinite(lse)
            p = np.exp(np.where(vis, s - np.where(np.isfinite(lse), lse, 0.0), -np.inf))
            w = p * a
            s_lse = max(s_lse, _max_abs(w.sum(-1)))
            dev = np.abs(v3[b][None, :, :] - o3[b, r0:r1, None, :])      # (rows, nk, d)
            s_out = max(s_out, _max_abs(np.einsum("ij,ijc->ic", w, dev)))
    return s_out, s_lse


def check_forward(out, lse, q, k, v, causal, scale, oracle=None):
    """Assert that ``(out, lse)`` from numba_flash matches the float64 oracle.

    Rows that see no key must be exactly out = 0 and lse = -inf. Elsewhere:

    * float32: the error may be at most twice that of a plain float32 NumPy
      computation (:func:`baseline_fwd32`), plus 1e-6 · max|v| (a few ulps), plus
      ``SLACK_ULPS`` times the problem's sensitivity to logit rounding
      (:func:`rounding_sensitivity`). The last term matters only for large logits,
      where the errors of two correct float32 programs vary by more than 2x.
    * float64: 1e-12 relative to max(1, max|oracle|), plus the same sensitivity term
      at float64's unit roundoff.

    ``causal`` is a bool or a dict of score options (:func:`score_options`), given to the
    oracle, the baseline and the sensitivity alike; k, v may have fewer heads than q.
    """
    q, k, v = (np.asarray(x) for x in (q, k, v))
    dtype = q.dtype
    lead, nq, d = q.shape[:-2], q.shape[-2], q.shape[-1]
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == dtype and lse.dtype == dtype
    assert out.shape == lead + (nq, d)
    assert lse.shape == lead + (nq,)
    assert not np.isnan(out).any(), "NaN in out (an element the kernel never wrote?)"
    assert not np.isnan(lse).any(), "NaN in lse (an element the kernel never wrote?)"
    assert np.isfinite(out).all()
    assert not np.isposinf(lse).any()

    if oracle is None:
        oracle = reference.attention_fwd(q, k, v, scale=scale, **score_options(causal))
    ref_out, ref_lse = oracle
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="lse must be -inf exactly where no key is visible")
    assert np.all(out[empty] == 0), "rows with no visible key must be exactly 0"

    fin = ~empty
    err_out = _max_abs(out.astype(np.float64) - ref_out)
    err_lse = _max_abs(lse[fin].astype(np.float64) - ref_lse[fin])
    sens_out, sens_lse = rounding_sensitivity(q, k, v, causal, scale, ref_out, ref_lse)
    if dtype == np.float64:
        tol_out = 1e-12 * max(1.0, _max_abs(ref_out)) + SLACK_ULPS * U64 * sens_out
        tol_lse = 1e-12 * max(1.0, _max_abs(ref_lse[fin])) + SLACK_ULPS * U64 * sens_lse
    else:
        base_out, base_lse = baseline_fwd32(q, k, v, causal, scale)
        tol_out = (2 * _max_abs(base_out.astype(np.float64) - ref_out) + 1e-6 * _max_abs(v)
                   + SLACK_ULPS * U32 * sens_out)
        tol_lse = (2 * _max_abs(base_lse[fin].astype(np.float64) - ref_lse[fin])
                   + 1e-6 * max(1.0, _max_abs(ref_lse[fin])) + SLACK_ULPS * U32 * sens_lse)
    assert err_out <= tol_out, f"out: max error {err_out:.3e} > tolerance {tol_out:.3e}"
    assert err_lse <= tol_lse, f"lse: max error {err_lse:.3e} > tolerance {tol_lse:.3e}"


def host(x):
    """A NumPy copy of a device array (Numba, or anything with copy_to_host), a PyTorch
    tensor (bfloat16 as ``ml_dtypes.bfloat16``) or a CuPy array."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return x.get()              # CuPy


def bits(x):
    """The raw bytes of an array, for bitwise comparisons."""
    x = np.ascontiguousarray(x)
    return x.dtype, x.shape, x.tobytes()


def pytest_runtest_logreport(report):
    """With ``NUMBA_FLASH_FAILURE_LOG=<path>``, append each failure's report to that file as it
    happens (a run cut short by a time limit still leaves its failures behind)."""
    path = os.environ.get("NUMBA_FLASH_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):   # once, not per process
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
