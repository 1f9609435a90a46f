"""The on-disk kernel cache (``numba_flash._kernel_cache``) and ``numba_flash.warmup``.

Without a GPU: the keys (every part of the key changes the file), entries written
atomically and read back, bad entries (corrupted, truncated, foreign, unloadable)
detected and deleted, the environment variables, the store/load logic with the driver
replaced by a stand-in, ``launch``'s use of a loaded kernel, and ``warmup`` in the
simulator. On a GPU: a call in two fresh processes, the second loading every kernel
from the cache (no compile) with bitwise-equal results; unloadable entries replaced;
and ``warmup`` covering what a later process's calls need.
"""
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import numba_flash
from numba_flash import _kernel_cache as kc
from numba_flash import launch as _launch
from numba_flash import registry

from conftest import HANG_GUARD_S, ON_GPU, ROOT, process_failure, project_env

ENV = (("source", "abc"), ("python", "3.11"), ("numba", "0.68.1"), ("numba-cuda", "0.30.4"),
       ("llvmlite", "0.50.0"), ("cc", "9.0"), ("driver", 13000), ("nvvm", (2, 0)), ("nvjitlink", (13, 0)),
       ("numba options", {"OPT": "3"}))
ARGKEY = ((np.dtype(np.uint16), 4, "C"), (np.dtype(np.float32), 3, "C"), np.float32, int)
PTYPES = _launch._param_ctypes(ARGKEY)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory, the cache switched on (as on a GPU), counters reset."""
    where = tmp_path / "cache"
    monkeypatch.setenv(kc.ENV_DIR, str(where))
    monkeypatch.delenv(kc.ENV_SWITCH, raising=False)
    monkeypatch.setattr(kc, "SIMULATOR", False)
    monkeypatch.setattr(kc, "stats", {"loaded": 0, "stored": 0, "rejected": 0})
    monkeypatch.setattr(kc, "_warned", False)
    return where


# --------------------------------------------------------------------------- keys
def test_every_key_part_changes_the_path(tmp_path):
    base = kc.entry_path(kc.key_text("forward_mma/bfloat16/d64|Spec()|f", ARGKEY, ENV), str(tmp_path))
    assert base == kc.entry_path(kc.key_text("forward_mma/bfloat16/d64|Spec()|f", ARGKEY, ENV), str(tmp_path))
    assert os.path.dirname(base) == str(tmp_path) and base.endswith(kc.SUFFIX)
    variants = [kc.key_text("forward_mma/bfloat16/d128|Spec()|f", ARGKEY, ENV)]
    for i, part in enumerate(ARGKEY):           # dtype, ndim, layout, scalar type of each argument
        if isinstance(part, tuple):
            dtype, ndim, layout = part
            for changed in ((np.dtype(np.int16), ndim, layout), (dtype, ndim + 1, layout),
                            (dtype, ndim, "A" if layout == "C" else "C")):
                variants.append(kc.key_text("forward_mma/bfloat16/d64|Spec()|f",
                                            ARGKEY[:i] + (changed,) + ARGKEY[i + 1:], ENV))
        else:
            other = np.float64 if part is not np.float64 else int
            variants.append(kc.key_text("forward_mma/bfloat16/d64|Spec()|f", ARGKEY[:i] + (other,) + ARGKEY[i + 1:],
                                        ENV))
    for i, (name, value) in enumerate(ENV):     # source hash, versions, cc, driver, NVVM, ...
        env = ENV[:i] + ((name, f"{value}+1"),) + ENV[i + 1:]
        variants.append(kc.key_text("forward_mma/bfloat16/d64|Spec()|f", ARGKEY, env))
    paths = {kc.entry_path(t, str(tmp_path)) for t in variants}
    assert len(paths) == len(variants) and base not in paths


def test_entry_file_is_the_key_hash(tmp_path):
    path = kc.entry_path("some key", str(tmp_path))
    assert os.path.basename(path) == hashlib.sha256(b"some key").hexdigest() + kc.SUFFIX


def test_kernel_keys_are_the_same_in_every_process():
    """The keys of every registered kernel (built, not compiled: no GPU needed) come out
    the same in two processes with different string hashing, and differ between kernels:
    a key that changed from process to process would make every load miss."""
    code = ("import hashlib, json\n"
            "from numba_flash import registry, _kernel_cache as kc\n"
            "kerns = {}\n"
            "for spec in registry.specialisations():\n"
            "    k = spec.kernel()\n"
            "    kerns[id(k)] = kc.kernel_key(k)\n"
            "keys = sorted(kerns.values())\n"
            "print(json.dumps([len(keys), len(set(keys)), hashlib.sha256('|'.join(keys).encode()).hexdigest()]))\n")
    found = []
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              env=project_env(NUMBA_ENABLE_CUDASIM="0", PYTHONHASHSEED=seed), timeout=HANG_GUARD_S)
        assert proc.returncode == 0, process_failure(proc)
        found.append(json.loads(proc.stdout.splitlines()[-1]))
    assert found[0] == found[1] and found[0][0] == found[0][1] > 100, found


def test_source_hash_follows_every_python_file(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "kernels" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "kernels" / "b.py").write_text("y = 2\n")
    first = kc.source_hash(str(pkg))
    (pkg / "kernels" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "notes.txt").write_text("not code")
    assert kc.source_hash(str(pkg)) == first
    (pkg / "kernels" / "b.py").write_text("y = 3\n")
    assert kc.source_hash(str(pkg)) != first
    (pkg / "kernels" / "b.py").write_text("y = 2\n")
    (pkg / "kernels" / "c.py").write_text("")
    assert kc.source_hash(str(pkg)) != first
    assert len(kc.source_hash()) == 64       # the package's own


def _factory(flag, width, inner=None):
    def kernel(a):
        if flag:
            return a * width
        return inner(a) if inner is not None else a
    return kernel


class _Dispatcher:
    """What the cache reads of a Numba dispatcher: py_func, and attributes it may set."""
    def __init__(self, py_func):
        self.py_func = py_func


def test_function_fingerprint_tells_closures_apart():
    fp = kc.function_fingerprint
    assert fp(_factory(True, 4)) == fp(_factory(True, 4))
    assert fp(_factory(True, 4)) != fp(_factory(False, 4))     # a patched factory's flag
    assert fp(_factory(True, 4)) != fp(_factory(True, 8))
    a = _Dispatcher(_factory(True, 4))
    b = _Dispatcher(_factory(True, 8))
    assert fp(_factory(False, 1, a)) != fp(_factory(False, 1, b))   # a device function's own closure


def test_tag_and_key():
    kern = _Dispatcher(_factory(True, 4))
    assert kc.kernel_key(kern) is None and kc.kernel_name(kern) is None       # untagged: not cached
    spec = registry.specialisation("forward_simt", "float32", 8)
    kc.tag(kern, spec.name, spec)
    kc.tag(kern, "other", "other")                       # the first tag stays
    assert kc.kernel_name(kern) == spec.name
    key = kc.kernel_key(kern)
    assert key.startswith(spec.name + "|" + repr(spec)) and key.endswith(kc.function_fingerprint(kern.py_func))
    built = spec.kernel()                                  # the registry tags its kernels
    assert kc.kernel_name(built) == spec.name


# --------------------------------------------------------------------------- entries
def _entry(tmp_path, text="key", cubin=b"\x7fELF" + bytes(range(256)) * 4):
    path = kc.entry_path(text, str(tmp_path))
    assert kc.write_entry(path, text, "_Z6kernel", ["c_int64", "c_float"], cubin)
    return path, cubin


def test_write_then_read_back(tmp_path):
    path, cubin = _entry(tmp_path)
    assert kc.read_entry(path, "key") == ("_Z6kernel", ["c_int64", "c_float"], cubin)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]      # no temporary file left
    path2, cubin2 = _entry(tmp_path, cubin=b"other")                      # replaced whole
    assert path2 == path and kc.read_entry(path, "key")[2] == b"other"


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage", "other key", "tail"])
def test_bad_entries_are_detected_and_deleted(tmp_path, damage, monkeypatch):
    monkeypatch.setattr(kc, "stats", {"loaded": 0, "stored": 0, "rejected": 0})
    path, _ = _entry(tmp_path)
    data = open(path, "rb").read()
    text = "key"
    if damage == "flip":
        data = data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = b""
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "tail":
        data = data + b"\0"
    else:
        text = "another key"          # a valid entry at the path of another key
    open(path, "wb").write(data)
    assert kc.read_entry(path, text) is None
    assert not os.path.exists(path) and kc.stats["rejected"] == 1


def test_concurrent_writers_never_show_half_files(tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "stats", {"loaded": 0, "stored": 0, "rejected": 0})
    text = "shared key"
    path = kc.entry_path(text, str(tmp_path))
    blobs = [bytes([i]) * (50_000 + 7919 * i) for i in range(4)]
    stop = threading.Event()

    def writer(blob):
        while not stop.is_set():
            kc.write_entry(path, text, "_Z1k", ["c_int64"], blob)

    threads = [threading.Thread(target=writer, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    try:
        seen = set()
        for _ in range(300):
            found = kc.read_entry(path, text)
            if found is not None:
                assert found[2] in blobs
                seen.add(found[2][0])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert kc.stats["rejected"] == 0 and seen
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []


# --------------------------------------------------------------------------- where, whether
def test_directory_and_switch(monkeypatch, tmp_path):
    monkeypatch.delenv(kc.ENV_DIR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kc.directory() == str(tmp_path / "home" / ".cache" / "numba_flash")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.directory() == str(tmp_path / "xdg" / "numba_flash")
    monkeypatch.setenv(kc.ENV_DIR, str(tmp_path / "moved"))
    assert kc.directory() == str(tmp_path / "moved")
    assert kc.enabled() is (not numba_flash.SIMULATOR)      # never in the simulator
    monkeypatch.setattr(kc, "SIMULATOR", False)
    assert kc.enabled()
    monkeypatch.setenv(kc.ENV_SWITCH, "0")
    assert not kc.enabled()


class _Lib:
    def __init__(self, cubin, **extra):
        self.cubin, self._entry_name = cubin, "_ZN6cudapy6kernelE"
        self._setup_functions, self._teardown_functions, self.referenced_objects = [], [], {}
        self.needs_cudadevrt = False
        self.__dict__.update(extra)

    def get_cubin(self, cc=None):
        return self.cubin


class _Compiled:
    def __init__(self, cubin=b"\x7fELF cubin bytes", **extra):
        self._codelibrary = _Lib(cubin, **extra)
        self.debug = self.cooperative = False
        self.shared_memory_carveout = None


@pytest.fixture
def fake_gpu(cache_dir, monkeypatch):
    """The GPU-side pieces replaced: a fixed environment, and a driver 'load' that returns
    the cubin it was given (None for cubins starting with b'bad')."""
    monkeypatch.setattr(kc, "environment", lambda: ENV)
    loads = []

    def load_function(cubin, name):
        loads.append((cubin, name))
        return None if cubin.startswith(b"bad") else ("CUfunction", cubin, name)
    monkeypatch.setattr(kc, "_load_function", load_function)
    kern = _Dispatcher(_factory(True, 4))
    kc.tag(kern, "forward_simt/float32/d8/full/async", "spec")
    return kern, loads


def test_store_then_load(fake_gpu, cache_dir):
    kern, loads = fake_gpu
    assert kc.load(kern, ARGKEY, PTYPES) is None                        # nothing yet
    assert kc.store(kern, ARGKEY, _Compiled(), PTYPES)
    assert len(os.listdir(cache_dir)) == 1 and kc.info()["entries"] == 1
    assert kc.load(kern, ARGKEY, PTYPES) == ("CUfunction", b"\x7fELF cubin bytes", "_ZN6cudapy6kernelE")
    assert kc.stats == {"loaded": 1, "stored": 1, "rejected": 0}
    other = ARGKEY[:-1] + (np.float64,)
    assert kc.load(kern, other, _launch._param_ctypes(other)) is None   # other argument types: a miss
    assert kc.load(_Dispatcher(_factory(True, 4)), ARGKEY, PTYPES) is None   # untagged
    kc.forget(kern, ARGKEY)                       # (a loaded kernel the driver would not launch)
    assert kc.info()["entries"] == 0
    assert kc.store(kern, ARGKEY, _Compiled(), PTYPES)
    assert kc.clear() == 1 and kc.info()["entries"] == 0


def test_unloadable_or_mismatched_entries_are_deleted(fake_gpu, cache_dir):
    kern, loads = fake_gpu
    assert kc.store(kern, ARGKEY, _Compiled(b"bad cubin"), PTYPES)
    assert kc.load(kern, ARGKEY, PTYPES) is None and os.listdir(cache_dir) == []
    assert kc.store(kern, ARGKEY, _Compiled(), PTYPES)
    assert kc.load(kern, ARGKEY, PTYPES[:-1]) is None and os.listdir(cache_dir) == []   # other parameters
    assert kc.stats["rejected"] == 2


def test_kernels_that_need_more_than_their_cubin_are_not_stored(fake_gpu, cache_dir):
    kern, _ = fake_gpu
    for extra in ({"_setup_functions": [print]}, {"referenced_objects": {1: object()}}, {"needs_cudadevrt": True}):
        assert not kc.store(kern, ARGKEY, _Compiled(**extra), PTYPES)
    compiled = _Compiled()
    compiled.debug = True
    assert not kc.store(kern, ARGKEY, compiled, PTYPES)
    assert not os.path.exists(cache_dir) or os.listdir(cache_dir) == []


def test_switched_off_and_moved(fake_gpu, cache_dir, monkeypatch, tmp_path):
    kern, _ = fake_gpu
    monkeypatch.setenv(kc.ENV_SWITCH, "0")
    assert not kc.store(kern, ARGKEY, _Compiled(), PTYPES)
    assert not os.path.exists(cache_dir)
    monkeypatch.setenv(kc.ENV_SWITCH, "1")
    monkeypatch.setenv(kc.ENV_DIR, str(tmp_path / "elsewhere"))
    assert kc.store(kern, ARGKEY, _Compiled(), PTYPES)
    assert len(os.listdir(tmp_path / "elsewhere")) == 1 and not os.path.exists(cache_dir)
    monkeypatch.setenv(kc.ENV_SWITCH, "0")
    assert kc.load(kern, ARGKEY, PTYPES) is None                      # off: not read either


def test_unwritable_directory_warns_once(fake_gpu, monkeypatch, tmp_path):
    kern, _ = fake_gpu
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(kc.ENV_DIR, str(blocker / "cache"))        # under a file: cannot be made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not kc.store(kern, ARGKEY, _Compiled(), PTYPES)
        assert not kc.store(kern, ARGKEY, _Compiled(b"other"), PTYPES)
        assert kc.load(kern, ARGKEY, PTYPES) is None
    assert [w.category for w in caught] == [kc.KernelCacheWarning]


def test_a_failed_rename_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "_warned", True)        # (the warning is tested above)

    def broken(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kc.os, "replace", broken)
    path = kc.entry_path("key", str(tmp_path))
    assert not kc.write_entry(path, "key", "_Z1k", [], b"cubin")
    assert os.listdir(tmp_path) == []


def test_launch_takes_a_loaded_kernel(monkeypatch):
    """``launch._from_cache``: a kernel the cache loads goes to the fast path, marked as
    loaded (launch then opts it in to large shared memory itself), and is opted in to the
    launch's dynamic shared memory when that is above 48 KiB."""
    monkeypatch.setattr(_launch, "_fast", {})
    monkeypatch.setattr(kc, "load", lambda kern, argkey, ptypes: "handle")
    opted = []
    monkeypatch.setattr(_launch, "_opt_in_function", lambda handle, n: opted.append((handle, n)) or True)
    key = ("kern", 1234, ARGKEY)
    entry = _launch._from_cache("kern", key, 1024)
    assert entry == ["handle", PTYPES, _launch.DEFAULT_SMEM_LIMIT, True] and _launch._fast[key] is entry
    assert opted == []
    key2 = ("kern", 1234, ARGKEY[:-1])
    assert _launch._from_cache("kern", key2, 100_000)[2] == 100_000 and opted == [("handle", 100_000)]
    assert _launch._from_cache("kern", ("kern", None, ARGKEY), 0) is None      # no context
    monkeypatch.setattr(kc, "load", lambda kern, argkey, ptypes: None)
    assert _launch._from_cache("kern", ("kern", 1, (int,)), 0) is None


def test_launch_paths(monkeypatch):
    """``launch.launch`` outside the simulator, the driver and Numba replaced by recorders:
    a cache hit launches straight away (no Numba), a loaded kernel the driver refuses is
    forgotten and compiled, a miss is compiled and recorded, and a loaded kernel launched
    later with more shared memory is opted in by ``launch`` itself."""
    calls = []
    monkeypatch.setattr(_launch, "SIMULATOR", False)
    monkeypatch.setattr(_launch, "_fast", {})
    monkeypatch.setattr(_launch, "context_handle", lambda: 77)
    hits = {}

    def from_cache(kern, key, smem):
        if kern not in hits:
            return None
        entry = _launch._fast[key] = ["fn-" + kern, _launch._param_ctypes(key[2]), _launch.DEFAULT_SMEM_LIMIT, True]
        return entry

    def fast(entry, grid, block, smem, args, stream):
        calls.append(("fast", entry[0], smem))
        if entry[0] == "fn-refused":
            raise RuntimeError("cuLaunchKernel failed")
    monkeypatch.setattr(_launch, "_from_cache", from_cache)
    monkeypatch.setattr(_launch, "_launch_fast", fast)
    monkeypatch.setattr(_launch, "_launch_numba", lambda kern, *a: calls.append(("numba", kern)))
    monkeypatch.setattr(_launch, "_record", lambda kern, key, args, smem: calls.append(("record", kern)))
    monkeypatch.setattr(_launch, "_opt_in_function", lambda h, n: calls.append(("opt in", h, n)) or True)
    monkeypatch.setattr(kc, "forget", lambda kern, argkey: calls.append(("forget", kern)))
    hits.update(cached=True, refused=True)
    args = (3, np.float32(1.5))
    _launch.launch("cached", 1, 32, 0, args)
    assert calls == [("fast", "fn-cached", 0)]
    calls.clear()
    _launch.launch("cached", 1, 32, 100_000, args)               # more shared memory: opted in here
    assert calls == [("opt in", "fn-cached", 100_000), ("fast", "fn-cached", 100_000)]
    calls.clear()
    _launch.launch("refused", 1, 32, 0, args)
    assert calls == [("fast", "fn-refused", 0), ("forget", "refused"), ("numba", "refused"), ("record", "refused")]
    calls.clear()
    _launch.launch("missing", 1, 32, 0, args)
    assert calls == [("numba", "missing"), ("record", "missing")]


def test_param_ctypes():
    assert _launch._param_ctypes(((np.dtype(np.float32), 2, "C"), np.float32, int)) == (
        (ctypes.c_int64,) * 9 + (ctypes.c_float, ctypes.c_int64))


# --------------------------------------------------------------------------- warmup, report
def test_warmup_runs_in_the_simulator():
    names = numba_flash.warmup([(2, 3, 40, 8)], dtypes=("float32",), causal=(False, True), backward=True)
    assert {n.split("/")[0] for n in names} == {"forward_simt", "forward_merge", "backward_delta",
                                                 "backward_dkdv_simt", "backward_dq_simt"}
    assert any("/causal/" in n for n in names) and any("/full/" in n for n in names)
    decode = numba_flash.warmup([(1, 2, 1, 16)], dtypes=("bfloat16",))
    assert decode == ["forward_merge/bfloat16/d0/full/plain", "forward_mma_split/bfloat16/d16/full/async"] + (
        ["forward_mma_split/bfloat16/d16/full/async/keywarps"] if registry.BLOCK_SPLITS else [])
    with pytest.raises(ValueError):
        numba_flash.warmup([(16,)])


def test_report_names_the_cache(monkeypatch, tmp_path):
    from numba_flash.__main__ import report
    monkeypatch.setenv(kc.ENV_DIR, str(tmp_path / "reported"))
    text = report()
    line = next(l for l in text.splitlines() if l.startswith("kernel cache"))
    assert str(tmp_path / "reported") in line and "0 entries" in line
    state = line.split(":", 1)[1].split(";")[0].split()[0]
    assert state == ("off" if numba_flash.SIMULATOR else "on"), line


# --------------------------------------------------------------------------- on a GPU
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="the cache stores and loads compiled kernels on a GPU only")

_CALLS = """
import hashlib, json, sys
import numpy as np, ml_dtypes
import numba_flash
from numba_flash import _kernel_cache, launch
rng = np.random.default_rng(7)
digest = hashlib.sha256()
for dtype, d, causal in (("float32", 64, False), ("float32", 128, True), ("bfloat16", 64, True),
                         ("bfloat16", 128, False)):
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    q, k, v = (rng.standard_normal((2, 4, SEQ, d)).astype(dt) for _ in range(3))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
    grads = numba_flash.attention_bwd(np.ones_like(out), q, k, v, out, lse, causal=causal)
    for x in (out, lse) + tuple(grads):
        digest.update(np.ascontiguousarray(x).view(np.uint8).tobytes())
    dec = numba_flash.attention(q[:, :, :1], k, v)                     # decoding: another kernel
    digest.update(np.ascontiguousarray(dec).view(np.uint8).tobytes())
print(json.dumps({"stats": _kernel_cache.stats, "digest": digest.hexdigest(),
                  "compiled_here": sum(1 for key, e in launch._fast.items()
                                       if _kernel_cache.kernel_name(key[0]) and not e[3])}))
"""


def _run(code, cache, **env):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=project_env(**{"NUMBA_FLASH_CACHE_DIR": str(cache), "NUMBA_FLASH_CACHE": None, **env}),
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    return json.loads(proc.stdout.splitlines()[-1])


@GPU_ONLY
def test_second_process_loads_every_kernel_from_the_cache(tmp_path):
    code = _CALLS.replace("SEQ", "300")
    first = _run(code, tmp_path)
    assert first["stats"]["stored"] > 0 and first["stats"]["loaded"] == 0
    assert first["compiled_here"] == first["stats"]["stored"]
    second = _run(code, tmp_path)
    assert second["stats"] == {"loaded": first["stats"]["stored"], "stored": 0, "rejected": 0}
    assert second["compiled_here"] == 0                                 # Numba compiled nothing
    assert second["digest"] == first["digest"]                          # bitwise-identical results
    off = _run(code, tmp_path, NUMBA_FLASH_CACHE="0")
    assert off["stats"] == {"loaded": 0, "stored": 0, "rejected": 0} and off["digest"] == first["digest"]


@GPU_ONLY
def test_unloadable_entries_are_replaced(tmp_path):
    code = _CALLS.replace("SEQ", "70")
    first = _run(code, tmp_path)
    # every entry rewritten with its own key but a cubin the driver refuses (valid checksum)
    spoil = ("import os, sys\n"
             "from numba_flash import _kernel_cache as kc\n"
             "for name in os.listdir(sys.argv[1]):\n"
             "    path = os.path.join(sys.argv[1], name)\n"
             "    data = open(path, 'rb').read()\n"
             "    import json, struct\n"
             "    payload = data[len(kc.MAGIC) + 32:]\n"
             "    n, = struct.unpack('<I', payload[:4])\n"
             "    header = json.loads(payload[4:4 + n])\n"
             "    kc.write_entry(path, header['key'], header['entry'], header['params'], b'not a cubin' * 10)\n")
    subprocess.run([sys.executable, "-c", spoil, str(tmp_path)], cwd=ROOT, check=True, env=project_env(),
                   timeout=HANG_GUARD_S)
    second = _run(code, tmp_path)
    n = first["stats"]["stored"]
    assert second["stats"] == {"loaded": 0, "stored": n, "rejected": n}
    assert second["digest"] == first["digest"]
    third = _run(code, tmp_path)
    assert third["stats"] == {"loaded": n, "stored": 0, "rejected": 0} and third["digest"] == first["digest"]


@GPU_ONLY
def test_warmup_covers_the_calls_it_describes(tmp_path):
    warm = ("import json, numba_flash\n"
            "from numba_flash import _kernel_cache\n"
            "names = numba_flash.warmup([(2, 4, 300, 64), (2, 4, 300, 128), (2, 4, 1, 64), (2, 4, 1, 128)],\n"
            "                           dtypes=('float32', 'bfloat16'), causal=(False, True), backward=True)\n"
            "print(json.dumps({'names': names, 'stats': _kernel_cache.stats}))\n")
    warmed = _run(warm, tmp_path)
    assert warmed["stats"]["stored"] > 0
    later = _run(_CALLS.replace("SEQ", "300"), tmp_path)
    assert later["stats"]["stored"] == 0 and later["compiled_here"] == 0, (later, warmed["names"])

