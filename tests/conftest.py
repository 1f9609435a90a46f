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
import os
import warnings

# numba_flash warns once, at import, when it switches the simulator on.
warnings.filterwarnings("ignore", message="numba_flash: no CUDA GPU found")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import numba_flash  # noqa: E402
import numba_flash.api  # noqa: E402
from numba_flash._runtime import classes_named  # noqa: E402

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


def process_failure(proc, what="the process"):
    """The assertion message for a subprocess that failed: its exit status and the last
    line of its stderr (the exception, which a one-line test summary then shows), then the
    tails of its stdout and stderr."""
    err = proc.stderr or ""
    last = next((line for line in reversed(err.splitlines()) if line.strip()), "")
    return f"{what} exited {proc.returncode}: {last}\n{(proc.stdout or '')[-3000:]}\n{err[-3000:]}"


def run_compile_probe(code):
    """The stdout of ``python -c code`` from the project's root, run as a user would
    without the simulator (``NUMBA_ENABLE_CUDASIM=0``: it compiles, with no GPU needed);
    the test fails with the tail of its stderr if the process fails."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", code], env=project_env(NUMBA_ENABLE_CUDASIM="0"), cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    return proc.stdout


def start_ptx_compile(args, env, code=None):
    """``python -m numba_flash.ptx *args`` (with ``code``: ``python -c code``, a compile
    probe of :func:`run_compile_probe`'s kind) in the background at a lower priority, so the
    compiles use the CPU that the simulator tests leave idle (collected with
    :func:`collect_ptx_compile`). Its output goes to temporary files, not pipes: a pipe
    that nobody reads until the end fills at 64 KiB and stops the process at its next
    line (the compiles then waited for the tests they were meant to overlap, and each
    for the one collected before it)."""
    import subprocess
    import sys
    import tempfile
    nice = (lambda: os.nice(10)) if hasattr(os, "nice") else None
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    argv = ["-c", code] if code is not None else ["-m", "numba_flash.ptx", *args]
    p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, preexec_fn=nice, stdout=out, stderr=err,
                         text=True)
    p.output_files = (out, err)
    return p


def collect_ptx_compile(p, timeout=None):
    """``(stdout, stderr)`` of a :func:`start_ptx_compile` process once it has ended
    (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
    p.wait(timeout=timeout)
    texts = []
    for f in p.output_files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return tuple(texts)

_QUIET = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, max_examples=40 if ON_GPU else 12, **_QUIET)
settings.register_profile("thorough", max_examples=200, **_QUIET)
settings.register_profile("gpu", max_examples=150, **_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# numba's performance warning lives in numba.core.errors; numba-cuda has its own class.
_PERF_WARNINGS = classes_named("NumbaPerformanceWarning",
                               ("numba.core.errors", "numba.cuda.core.errors", "numba.cuda.errors"))
for _cls in _PERF_WARNINGS:
    warnings.filterwarnings("ignore", category=_cls)
warnings.filterwarnings("ignore", category=numba_flash.SimulatorWarning)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "ignore::numba_flash.SimulatorWarning")
    for cls in _PERF_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore::{cls.__module__}.{cls.__qualname__}")


# Test modules whose offline compiles run in the background (each has start_runs/stop_runs).
_BACKGROUND_COMPILES = ("test_ptx", "test_ladder")


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for the background compiles run last: the simulator tests run
    meanwhile, on the core the compiles leave, instead of after them on one core."""
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", None) in _BACKGROUND_COMPILES)


def pytest_collection_finish(session):
    """Start the slow PTX compiles of test_ptx.py and test_ladder.py in the background right
    away, if those modules were selected: they use the CPU that the single-threaded simulator
    tests leave idle. Under pytest-xdist every worker collects every test: only the first
    (``gw0``) starts them here; a worker that runs those tests without having started them
    starts its own (``start_runs`` in their fixtures)."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
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


# The oracle checks and their helpers are public (numba_flash.testing); tests import them from here.
from numba_flash.testing import (SCORE_OPTIONS, SLACK_ULPS, U32, U64, _max_abs, alibi_bias,  # noqa: E402,F401
                                 baseline_fwd32, check_forward, expand_heads, rounding_sensitivity, score_options,
                                 score_rules, scores32, softmax32)
from numba_flash.testing import to_numpy as host  # noqa: E402,F401


def bits(x):
    """The raw bytes of an array, for bitwise comparisons."""
    x = np.ascontiguousarray(x)
    return x.dtype, x.shape, x.tobytes()


def pytest_runtest_logreport(report):
    """With ``NUMBA_FLASH_FAILURE_LOG=<path>``, append each failure's report to that file as it
    happens, and each finished test's id, outcome and seconds to ``<path>.done`` (a run cut
    short by a time limit still leaves its failures behind, and what it did not reach)."""
    path = os.environ.get("NUMBA_FLASH_FAILURE_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):     # once, not per process
        return
    if report.failed:
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
    if report.when == "call" or not report.passed:
        with open(path + ".done", "a") as f:
            f.write(f"{report.nodeid} {report.outcome} {report.duration:.1f}\n")
