"""The kernel ladder (numba_flash.ladder): every rung against the float64 oracle, its
registry, its inputs, its offline PTX, its docs and ``bench.py ladder`` (the tour,
examples/02_ladder_tour.py, runs in tests/test_examples.py).

In the simulator the shapes are tiny (one Python thread per CUDA thread) but cross the
simulator tiles of each rung (ragged N, Nq != Nk, ragged d, several head-dim chunks);
on a GPU the same tests add the seed problem and N, d up to 4096. The offline PTX
compiles start in a subprocess when this module's first test runs and are checked by
the last tests of the module.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)
from numba import cuda
from numba_flash import ladder, reference
from numba_flash.ladder import RUNGS
from conftest import HANG_GUARD_S, ON_GPU, baseline_fwd32, collect_ptx_compile, project_env, start_ptx_compile

ROOT = Path(__file__).resolve().parents[1]
CCS = ("8.0", "9.0")
IDS = [r.name for r in RUNGS]

# Per rung, shapes (Nq, Nk, d) that cross its simulator tiles: (Br, Bc[, Bd, DK]) =
# k01, k02: (4, 4); k03, k04: (2, 32, 32 / 64, 8); k05-k07: (2, 32, 128, 8); k08: (16, 16, 16, 8).
SIM_SHAPES = {
    1: [(6, 7, 5), (16, 16, 16)],
    2: [(6, 7, 5), (16, 16, 16)],
    3: [(3, 33, 9), (16, 16, 16)],
    4: [(3, 33, 9), (16, 16, 16)],
    5: [(3, 33, 12), (16, 16, 16)],
    6: [(3, 33, 12), (16, 16, 16)],
    7: [(3, 33, 12), (2, 40, 8), (16, 16, 16)],   # d = DK: the next chunk is always the next tile's first
    8: [(17, 20, 12), (16, 16, 16)],
}
GPU_SHAPES = [(16, 16, 16), (97, 113, 40), (1024, 1024, 1024), (4096, 4096, 64), (64, 64, 4096),
              (1000, 1000, 100)]


def _cases():
    for r in RUNGS:
        shapes = GPU_SHAPES if ON_GPU else SIM_SHAPES[r.number]
        for nq, nk, d in shapes:
            if r.vector and d % 4:
                continue
            yield pytest.param(r, nq, nk, d, id=f"{r.name}-{nq}x{nk}x{d}")


def _qkv(nq, nk, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))


def _check(out, q, k, v):
    """max |out - oracle| <= 2 × a plain float32 NumPy computation's error + a few ulps."""
    ref = reference.attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    assert not np.isnan(out).any(), "NaN in out (an element the kernel never wrote?)"
    base = baseline_fwd32(q, k, v, False, None)[0]
    tol = 2 * np.abs(base.astype(np.float64) - ref).max() + 1e-6 * max(1.0, np.abs(v).max())
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= tol, f"max error {err:.3e} > tolerance {tol:.3e}"


# --------------------------------------------------------------------------- offline PTX (started first)
_PTX = {}


def start_runs():
    """Start ``python -m numba_flash.ptx --ladder`` for every compute capability (once).
    conftest.py calls this as soon as collection finishes, so the compiles overlap the
    simulator tests (at a lower priority); ``ptx_rows`` collects them at the end."""
    if not _PTX:
        _PTX["ladder"] = start_ptx_compile(["--ladder", "--cc", ",".join(CCS)],
                                           project_env(NUMBA_ENABLE_CUDASIM="0"))
    return _PTX


def stop_runs():
    """Kill the run if it is still going (e.g. after ``pytest -x``)."""
    for p in _PTX.values():
        if p.poll() is None:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- registry
def test_registry_lists_the_eight_rungs_in_order():
    assert [r.number for r in RUNGS] == list(range(1, 9))
    assert len({r.slug for r in RUNGS}) == len(RUNGS)
    files = sorted(p.stem for p in (ROOT / "numba_flash" / "ladder").glob("k[0-9][0-9]_*.py"))
    assert files == [r.name for r in RUNGS], "every rung file is registered, and nothing else"
    for r in RUNGS:
        assert r.module.__name__ == f"numba_flash.ladder.{r.name}"
        assert r.title and r.change and callable(r)
        assert ladder.rung(r.number) is ladder.rung(r.slug) is ladder.rung(r.name) is r
    with pytest.raises(KeyError, match="k01_baseline"):
        ladder.rung(9)


@pytest.mark.parametrize("r", RUNGS, ids=IDS)
def test_rung_docstring_sections(r):
    doc = r.module.__doc__
    assert doc.startswith(f"Rung {r.number} — ")
    for section in ("**Measured** (", "**Caveats.**"):
        assert section in doc
    assert ("**What.**" if r.number == 1 else f"**Changed from rung {r.number - 1}.**") in doc
    measured = doc.split("**Measured** (")[1].split("\n\n")[0]
    assert "written by docs/gen_ladder.py" in measured and re.search(r"\d+\.\d{3} ms", measured), \
        "the Measured paragraph is the one gen_ladder writes from a bench.py ladder run"


# --------------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("r, nq, nk, d", list(_cases()))
def test_rung_matches_oracle(r, nq, nk, d):
    q, k, v = _qkv(nq, nk, d, seed=nq + 7 * d)
    _check(r(q, k, v), q, k, v)


@pytest.mark.parametrize("r", [ladder.rung(3), ladder.rung(7)], ids=lambda r: r.name)
def test_device_arrays_in_device_array_out(r):
    q, k, v = _qkv(5, 9, 8, seed=3)
    out = r(*(cuda.to_device(x) for x in (q, k, v)))
    assert not isinstance(out, np.ndarray) and hasattr(out, "copy_to_host")
    _check(out.copy_to_host(), q, k, v)


@pytest.mark.skipif(not ON_GPU, reason="N = d = 1024 is too large for the simulator")
@pytest.mark.parametrize("r", RUNGS, ids=IDS)
def test_seed_problem_within_1e4(r):
    """The seed's problem and input distribution, at its pass/fail tolerance."""
    q, k, v = ladder.seed_inputs(1024, 1024)
    err = np.abs(r(q, k, v).astype(np.float64) - reference.attention(q, k, v)).max()
    assert err <= 1e-4


@pytest.mark.parametrize("r", RUNGS, ids=IDS)
def test_rung_imports_stand_alone(r):
    """A rung copied out of the package runs as it is: absolute imports only, and numba_flash's
    GPU-or-simulator decision imported before numba."""
    import ast
    tree = ast.parse(Path(r.module.__file__).read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [n for n in imports if isinstance(n, ast.ImportFrom) and n.level], "relative import"
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in imports]
    first_numba = next(i for i, m in enumerate(names) if m.split(".")[0] == "numba")
    assert "numba_flash._runtime" in names[:first_numba]


def test_copied_rung_runs(tmp_path):
    import importlib.util
    path = tmp_path / "my_rung.py"
    path.write_text(Path(ladder.rung(1).module.__file__).read_text())
    spec = importlib.util.spec_from_file_location("my_rung", path)
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    q, k, v = _qkv(3, 5, 4)
    _check(mine.attention(q, k, v), q, k, v)


# --------------------------------------------------------------------------- inputs
def test_input_errors():
    r, rv = ladder.rung(1), ladder.rung(5)
    q, k, v = _qkv(4, 4, 6)
    with pytest.raises(TypeError, match="float32"):
        r(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match="2-D"):
        r(q[None], k, v)
    with pytest.raises(ValueError, match="same length"):
        r(q, k, v[:3])
    with pytest.raises(ValueError, match="share d"):
        r(q, k[:, :5], v)
    with pytest.raises(ValueError, match="non-empty"):
        r(q[:0], k, v)
    with pytest.raises(ValueError, match="multiple of 4"):
        rv(q, k, v)
    with pytest.raises(TypeError, match="all be NumPy arrays or all be device arrays"):
        r(cuda.to_device(q), k, v)
    with pytest.raises(TypeError, match="np.asarray"):
        r(q.tolist(), k, v)


# --------------------------------------------------------------------------- docs, bench
def test_docs_are_generated_from_the_rung_files():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_ladder.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_measured_paragraph_wording():
    """The wording gen_ladder writes into each rung's docstring states a regression and a
    missed target plainly."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen_ladder", ROOT / "docs" / "gen_ladder.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = {"gpu": {"name": "GPU"}, "date": "2026-01-02T00:00:00"}
    row = {"ours": {"ms_median": 3.0, "tflops": 1.0}, "seed_h200_ms": 2.0, "vs_previous": 0.5,
           "validation": {"max_abs_err": 2e-5, "valid": True, "tolerance": 1e-4}}
    text = " ".join(gen.measured_paragraph(row, 4, doc, "abc1234").split())
    assert "3.000 ms" in text and "Slower than rung 4 (0.50×): a regression" in text
    assert "1.50× slower: its target is missed" in text and "passes the seed's 1e-04" in text
    row.update(vs_previous=2.0, seed_h200_ms=6.0)
    text = " ".join(gen.measured_paragraph(row, 4, doc, "abc1234").split())
    assert "2.00× faster than rung 4" in text and "2.00× faster." in text


def test_bench_ladder_tiny(tmp_path):
    js, md = tmp_path / "l.json", tmp_path / "l.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench.py"), "ladder", "--tiny", "--repeats", "1",
                           "--warmup", "0", "--json", str(js), "--markdown", str(md)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    assert doc["mode"] == "ladder" and doc["settings"]["tolerance"] == 1e-4
    assert [row["rung"] for row in doc["rows"]] == [r.number for r in RUNGS]
    for row in doc["rows"]:
        assert row["valid"] and row["validation"]["max_abs_err"] <= 1e-4
        assert row["ours"]["ms_median"] > 0 and row["seed_h200_ms"] > 0
    assert doc["rows"][0]["vs_previous"] is None and doc["rows"][1]["vs_previous"] > 0
    table = proc.stdout[proc.stdout.index("\nrung "):]
    assert table.count(" pass ") == len(RUNGS)
    assert md.read_text().count("\n|") >= 2 + len(RUNGS)


# --------------------------------------------------------------------------- offline PTX (collected last)
@pytest.fixture(scope="module")
def ptx_rows():
    """{cc: {rung name: JSON row}} from the run ``start_runs`` started."""
    try:
        out, err = collect_ptx_compile(start_runs()["ladder"], timeout=HANG_GUARD_S)
        assert _PTX["ladder"].returncode == 0, f"python -m numba_flash.ptx --ladder failed:\n{err[-4000:]}"
    finally:
        stop_runs()
    rows = {cc: {} for cc in CCS}
    for row in map(json.loads, filter(str.strip, out.splitlines())):
        rows[row["cc"]][row["name"]] = row
    return rows


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("r", RUNGS, ids=IDS)
def test_rung_ptx_shows_its_feature(ptx_rows, cc, r):
    row = ptx_rows[cc][r.name]
    assert row["cc"] == cc
    missing = [f for f in r.ptx_claims if row[f] == 0]
    assert not missing, f"{r.name} claims {missing} but its PTX has none"
    assert row["f64"] == 0, "float32 kernels must not promote to float64"
    if r.number >= 3 and r.local_memory is None:
        assert row["local"] == 0, "register tiles must stay in registers (no .local)"
    if r.local_memory is not None:
        assert row["local"] > 0, f"{r.name} documents a local array its PTX no longer has: update it"


def test_ptx_claims_follow_the_ladder():
    """Each rung claims the feature it introduces (and keeps its predecessors' where it keeps the code)."""
    claims = {r.number: set(r.ptx_claims) for r in RUNGS}
    assert "shfl.sync" in claims[3]
    assert claims[5] >= {"ld.global.v4", "ld.shared.v4"}
    assert "cp.async" in claims[7]
    assert "mma.sync" in claims[8]
