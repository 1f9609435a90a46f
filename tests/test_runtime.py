"""The GPU-or-simulator decision (numba_flash._runtime): right whatever the import order,
an ImportError that says what to do where it cannot be, and a notice whose advice holds
on the machine it runs on, reported at the importing line."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)
from numba_flash import _runtime
from conftest import HANG_GUARD_S, process_failure, project_env, run_compile_probe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """_decide() as on a machine without a GPU, with NUMBA_ENABLE_CUDASIM unset."""
    monkeypatch.delenv(_runtime.ENV, raising=False)
    monkeypatch.setattr(_runtime, "_gpu_present", lambda: False)
    monkeypatch.setattr(_runtime, "_sync_numba_config", lambda simulator: None)


def test_notice_advice_and_location(no_gpu, monkeypatch):
    monkeypatch.setattr(_runtime, "_loaded_mode", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _runtime._decide() is True
    assert os.environ[_runtime.ENV] == "1"
    [w] = caught
    assert w.category is _runtime.SimulatorWarning and w.filename == __file__
    text = str(w.message)
    assert f"{_runtime.ENV}=1" in text and f"{_runtime.ENV}=0" not in text, \
        "=0 on a machine without a GPU only leads to CudaSupportError"


def test_numba_cuda_imported_first_without_gpu(no_gpu, monkeypatch):
    monkeypatch.setattr(_runtime, "_loaded_mode", lambda: False)          # numba.cuda in GPU mode
    monkeypatch.setattr(sys.modules["numba.cuda"], "is_available", lambda: False)
    with pytest.raises(ImportError) as err:
        _runtime._decide()
    text = " ".join(str(err.value).split())
    assert "import numba_flash before anything imports numba.cuda" in text
    assert f"set {_runtime.ENV}=1 before starting Python" in text


def test_env_contradicting_numba_cuda(monkeypatch):
    monkeypatch.setenv(_runtime.ENV, "1")
    monkeypatch.setattr(_runtime, "_loaded_mode", lambda: False)
    with pytest.raises(ImportError, match="asks for the simulator"):
        _runtime._decide()


def test_import_numba_first():
    """``import numba`` before numba_flash: the decision still holds (simulator without a GPU),
    kernels run, and the notice points at the importing line."""
    script = (
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "import numba\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import numba_flash\n"
        "import numpy as np\n"
        "from numba import cuda\n"
        "q = np.ones((1, 3, 4), np.float32)\n"
        "out = numba_flash.attention(q, q, q)\n"
        "print(json.dumps({'simulator': numba_flash.SIMULATOR, 'cuda_simulator': cuda.is_available.__module__"
        ".startswith('numba.cuda.simulator'), 'ok': bool(np.allclose(out, 1)), "
        "'where': [(w.filename, w.lineno) for w in caught if w.category is numba_flash.SimulatorWarning]}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=project_env(**{_runtime.ENV: None}), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["ok"] and got["simulator"] == got["cuda_simulator"]
    if got["simulator"]:
        assert got["where"] == [["<string>", 5]]


def test_ml_dtypes_deferred_until_imported():
    """``numba.cuda`` loads without ``ml_dtypes`` (``numba_flash/_deferred_ml_dtypes.py``);
    importing it afterwards gives numba-cuda the same bfloat16 entry as its own import does
    (``NUMBA_FLASH_DEFER_ML_DTYPES=0``), and bfloat16 arrays go to the device and back, and
    through an attention call, as before."""
    script = (
        "import json, sys\n"
        "import numba_flash\n"
        "early = 'ml_dtypes' in sys.modules\n"
        "import ml_dtypes, numpy as np\n"
        "from numba.cuda.np import numpy_support\n"
        "x = (np.arange(48).reshape(1, 2, 3, 8) / 16).astype(ml_dtypes.bfloat16)\n"
        "back = numba_flash.to_device(x).copy_to_host()\n"
        "out = numba_flash.attention(x, x, x)\n"
        "print(json.dumps({'early': early, 'entry': str(numpy_support.FROM_DTYPE.get(np.dtype(ml_dtypes.bfloat16))),"
        " 'back': back.astype(float).ravel().tolist(), 'out': out.astype(float).ravel().tolist(),"
        " 'dtype': str(out.dtype)}))\n")
    got = {}
    for defer in ("1", "0"):
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                              env=project_env(NUMBA_FLASH_DEFER_ML_DTYPES=defer), timeout=HANG_GUARD_S)
        assert proc.returncode == 0, process_failure(proc)
        got[defer] = json.loads(proc.stdout.splitlines()[-1])
    if not _runtime.pinned_numba_cuda("NUMBA_FLASH_DEFER_ML_DTYPES"):
        pytest.skip("another numba-cuda than the pinned one: nothing is deferred")
    assert got["1"].pop("early") is False and got["0"].pop("early") is True
    assert got["1"] == got["0"] and got["1"]["entry"] != "None" and got["1"]["dtype"] == "bfloat16"


def test_faster_compiles_compile_the_same_code():
    """numba_flash._inline_copies and _fast_analysis (installed at import, outside the
    simulator) make the inliner's IR copies, the liveness analysis and the SSA rewrites
    cheaper, not different: every liveness map computed while a kernel built from inlined
    device functions compiles equals numba's own, set for set, the compile flags list the same values,
    every answer of the array-operator template, every ABI size, every call signature and every function type's resolution (with its implementation key) equal numba's, and the kernel compiles to
    the same PTX with and without them (but for the names Numba numbers per compile)."""
    code = (
        "import re\n"
        "from numba.cuda.core import analysis, ir_utils\n"
        "from numba_flash import _fast_analysis, _inline_copies, ptx, registry\n"
        "assert _inline_copies._installed and _fast_analysis._originals\n"
        "numba_live_map, checked = _fast_analysis._originals['compute_live_map'], []\n"
        "def both(*args):\n"
        "    ours, theirs = _fast_analysis.compute_live_map(*args), numba_live_map(*args)\n"
        "    assert ours == theirs and list(ours) == list(theirs)\n"
        "    checked.append(len(ours))\n"
        "    return ours\n"
        "analysis.compute_live_map = ir_utils.compute_live_map = both\n"
        "from numba.cuda.typing.npydecl import NumpyRulesArrayOperator\n"
        "operators = []\n"
        "def operator_both(self, args, kws):\n"
        "    ours = _fast_analysis._array_operator(self, args, kws)\n"
        "    theirs = _fast_analysis._originals['array_operator'](self, args, kws)\n"
        "    assert ours == theirs, (args, ours, theirs)\n"
        "    operators.append(ours is None)\n"
        "    return ours\n"
        "NumpyRulesArrayOperator.generic = operator_both\n"
        "from numba.cuda.core.base import BaseContext\n"
        "sizes = []\n"
        "def size_both(self, ty):\n"
        "    ours, theirs = _fast_analysis._abi_sizeof(self, ty), _fast_analysis._originals['abi_sizeof'](self, ty)\n"
        "    assert ours == theirs, (str(ty), ours, theirs)\n"
        "    sizes.append(ours)\n"
        "    return ours\n"
        "BaseContext.get_abi_sizeof = size_both\n"
        "from numba.cuda.typing.context import BaseContext as TypingContext\n"
        "calls = []\n"
        "def calls_both(self, func, args, kws):\n"
        "    ours = _fast_analysis._resolve_function_type(self, func, args, kws)\n"
        "    theirs = _fast_analysis._originals['resolve_function_type'](self, func, args, kws)\n"
        "    assert ours == theirs, (func, args, ours, theirs)\n"
        "    calls.append(ours)\n"
        "    return ours\n"
        "TypingContext.resolve_function_type = calls_both\n"
        "call_types = []\n"
        "def call_type_both(self, context, args, kws):\n"
        "    ours = _fast_analysis._get_call_type(self, context, args, kws)\n"
        "    our_key = self._impl_keys[ours.args]\n"
        "    theirs = _fast_analysis._originals['get_call_type'](self, context, args, kws)\n"
        "    assert ours == theirs and self._impl_keys[theirs.args] == our_key, (args, ours, theirs)\n"
        "    call_types.append(ours)\n"
        "    return ours\n"
        "_fast_analysis._function_base().get_call_type = call_type_both\n"
        "for cls, markup in _fast_analysis._originals.get('markup', {}).items():   # (none without colorama)\n"
        "    scheme = cls()\n"
        "    for part in ('code', 'errmsg', 'filename', 'indicate', 'highlight', 'reset'):\n"
        "        ours = getattr(scheme, part)('No match for <T> at x.py:3')\n"
        "        cls._markup = markup\n"
        "        assert getattr(scheme, part)('No match for <T> at x.py:3') == ours, (cls, part)\n"
        "        assert scheme._markup('m', None, None) == _fast_analysis._markup(scheme, 'm', None, None)\n"
        "        cls._markup = _fast_analysis._markup\n"
        "assert len(_fast_analysis._originals.get('markup', ())) in (0, 2)\n"
        "from numba.cuda.flags import CUDAFlags\n"
        "flags = CUDAFlags(); flags.debuginfo = True; flags.fastmath = {'contract'}\n"
        "for f in (CUDAFlags(), flags, flags.copy()):\n"
        "    ours, theirs = _fast_analysis._flag_values(f), _fast_analysis._originals['values'](f)\n"
        "    assert ours == theirs and list(ours.items()) == list(theirs.items()), (ours, theirs)\n"
        "spec = registry.specialisation('forward_simt', 'float32', 32, registry.FULL, True, False)\n"
        "norm = lambda t: re.sub(r'_cudapy_smem_[0-9]+', 'S', re.sub(r'_ZN[0-9A-Za-z_]+', 'Z', t))\n"
        "with_patch = norm(ptx.compile_spec(spec, [(8, 0)])[(8, 0)])\n"
        "_fast_analysis.uninstall()\n"
        "_inline_copies.uninstall()\n"
        "without = norm(ptx.compile_spec(spec, [(8, 0)])[(8, 0)])\n"
        "print(with_patch == without, len(without), with_patch.count('fma.rn'), len(checked), max(checked),\n"
        "      sum(operators), len(operators) - sum(operators), len(sizes), len(calls), len(call_types))\n")
    out = run_compile_probe(code)
    same, size, fmas, maps, blocks, scalar_ops, array_ops, sizes, calls, call_types = out.split()
    assert same == "True" and int(size) > 10000 and int(fmas) > 0, out
    assert int(maps) > 20 and int(blocks) > 50, out     # (those read), the kernel's own IR among them
    assert int(scalar_ops) > 100, out                   # the template's answers compared
    assert int(sizes) > 100, out                        # ABI sizes compared
    assert int(calls) > 500, out                        # call signatures compared
    assert int(call_types) > 100, out                   # function types' resolutions compared


def test_compiles_run_without_collector_pauses_and_restore_it():
    """numba_flash._gc_pause (installed at import, outside the simulator) turns Python's
    cyclic collector off while numba-cuda's compiler lock is held and back on when the
    outermost hold ends, unless it was off before: no collection starts during a kernel's
    compile (numba starts hundreds), the collector is on after it, after a nested hold and
    after a compile that fails to type, and stays off for a caller who turned it off."""
    code = (
        "import gc\n"
        "from numba import cuda\n"
        "from numba.cuda.core.compiler_lock import global_compiler_lock\n"
        "from numba_flash import _gc_pause, ptx, registry\n"
        "assert _gc_pause._originals\n"
        "during, outside = [], []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and\n"
        "                    (during if _gc_pause._state['depth'] else outside).append(info['generation']))\n"
        "spec = registry.specialisation('forward_simt', 'float32', 32, registry.FULL, True, False)\n"
        "ptx.compile_spec(spec, [(8, 0)])\n"
        "assert gc.isenabled() and not during, during\n"
        "with global_compiler_lock:\n"
        "    with global_compiler_lock:\n"
        "        assert not gc.isenabled() and _gc_pause._state['depth'] == 2\n"
        "    assert not gc.isenabled()\n"
        "assert gc.isenabled() and _gc_pause._state['depth'] == 0\n"
        "def bad(x):\n"
        "    x[0] = undefined_name\n"
        "try:\n"
        "    cuda.compile_ptx(bad, 'void(float32[:])', cc=(8, 0))\n"
        "except Exception as e:\n"
        "    failed = type(e).__name__\n"
        "assert gc.isenabled() and _gc_pause._state['depth'] == 0\n"
        "gc.disable()\n"
        "ptx.compile_spec(registry.specialisation('forward_simt', 'float32', 16, registry.FULL, True, False), [(8, 0)])\n"
        "assert not gc.isenabled()\n"
        "gc.enable()\n"
        "_gc_pause.uninstall()\n"
        "before = len(outside)\n"
        "ptx.compile_spec(registry.specialisation('forward_simt', 'float32', 64, registry.FULL, True, False), [(8, 0)])\n"
        "print(failed, len(outside) - before)\n")
    out = run_compile_probe(code)
    failed, unpaused = out.split()
    assert failed == "TypingError", out
    assert int(unpaused) > 50, out      # uninstalled, a compile collects as before


def test_first_compile_finds_the_blas_without_importing_scipy():
    """numba-cuda's array lowering decides at import whether a BLAS is there; numba_flash
    makes that decision without importing scipy.linalg (0.12-0.19 s of a first call): a
    process that compiles a kernel never imports it, the decision is the one numba-cuda's
    own check makes, and its ``ensure_blas`` is numba-cuda's again afterwards."""
    code = (
        "import sys\n"
        "from numba_flash import ptx, registry\n"
        "ptx.compile_spec(registry.specialisation('forward_simt', 'float32', 32, registry.FULL, True, False), "
        "[(8, 0)])\n"
        "imported = 'scipy.linalg' in sys.modules\n"
        "from numba.cuda.np import arraymath, linalg\n"
        "try:\n"
        "    linalg.ensure_blas()\n"
        "    real = True\n"
        "except ImportError:\n"
        "    real = False\n"
        "print(imported, arraymath._HAVE_BLAS == real, arraymath.ensure_blas is linalg.ensure_blas, real)\n")
    out = run_compile_probe(code)
    imported, same, restored, _ = out.split()
    assert (imported, same, restored) == ("False", "True", "True"), out


def test_live_map_matches_numba_on_random_graphs():
    """``_fast_analysis.compute_live_map`` against numba's on random control-flow graphs
    (loops, unreachable blocks, blocks without variables), set for set."""
    from numba.cuda.core import analysis
    from numba.cuda.core.controlflow import CFGraph
    from numba_flash import _fast_analysis
    ours = _fast_analysis.compute_live_map
    theirs = _fast_analysis._originals.get("compute_live_map", analysis.compute_live_map)
    rng = np.random.default_rng()
    names = [f"v{i}" for i in range(40)]
    for _ in range(60):
        n = int(rng.integers(1, 30))
        labels = [int(x) for x in rng.permutation(1000)[:n]]
        cfg = CFGraph()
        for label in labels:
            cfg.add_node(label)
        for label in labels:
            for succ in rng.choice(labels, size=int(rng.integers(0, 3))):
                cfg.add_edge(label, int(succ))
        cfg.set_entry_point(labels[0])
        cfg.process()
        pick = lambda: set(rng.choice(names, size=int(rng.integers(0, 6)), replace=False))
        use, define = {l: pick() for l in labels}, {l: pick() for l in labels}
        blocks = dict.fromkeys(labels)
        assert ours(cfg, blocks, use, define) == theirs(cfg, blocks, use, define)


def test_python_m_numba_flash_reports_what_a_bug_report_needs():
    """``python -m numba_flash`` prints the versions, the device (here the simulator), the
    environment that changes behaviour and the kernel family of each dtype."""
    proc = subprocess.run([sys.executable, "-m", "numba_flash"], env=project_env(NUMBA_ENABLE_CUDASIM="1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    out = proc.stdout
    for needle in (f"numba_flash {numba_flash.__version__}", "numba-cuda 0.30.4", "numpy ", "simulator",
                   "NUMBA_ENABLE_CUDASIM=1", "float32   forward forward_simt", "bfloat16  forward forward_mma",
                   "decoding (<= 16 query rows) forward_mma_split"):
        assert needle in out, (needle, out)
