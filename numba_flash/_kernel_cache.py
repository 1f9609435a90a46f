"""Compiled kernels kept on disk, so that a new process does not compile them again.

Numba compiles each kernel the first time a process launches it with given argument
types: 5-9 seconds before a fresh process's first attention call returns. Numba's own
``cache=True`` cannot serve numba_flash: the float16/bfloat16 kernels carry linking
files (Numba refuses to pickle them), and the kernels are closures built by factories.
So numba_flash keeps the one thing a launch needs, the linked cubin, itself:

* **Store.** After Numba compiles a kernel on a GPU (``launch._launch_numba``, then
  ``launch._record``), :func:`store` writes its cubin (``_codelibrary.get_cubin()``,
  what Numba itself loads), the kernel's entry (mangled) name and the ctypes of its
  flattened parameters to one file, written to a temporary name and renamed into place
  (``os.replace``), so a concurrent process sees the whole file or none.
* **Load.** In a later process, the first launch of the same kernel with the same
  argument types finds that file (:func:`load`), checks it, loads the cubin with the
  driver (``cuModuleLoadData``, ``cuModuleGetFunction``) and gives ``launch`` the
  function for its fast path: Numba never compiles that kernel in this process.
  (``launch`` then opts the function in to more than 48 KiB of dynamic shared memory
  where a launch needs it, as it does for kernels Numba compiled.)
* **Key.** The file's name is the SHA-256 of everything that changes the code
  (:func:`key_text`): the kernel's identity (the registry specialisation's name and
  fields, which ``registry.Specialisation.kernel`` attaches with :func:`tag`, and a
  fingerprint of the kernel function's bytecode and simple closure values), the
  argument types (``launch``'s key of dtype, dimensions and layout per argument) and
  the :func:`environment`: a hash of numba_flash's own source files (any edit of the
  package invalidates every entry), the Python, numba, numba-cuda and llvmlite
  versions, the GPU's compute capability, the driver, NVVM and nvJitLink versions and
  Numba's code-changing settings. The full key text is stored in the file too and must
  match, so even a hash collision cannot load a wrong kernel.
* **Checks.** A file starts with a magic line and the SHA-256 of the rest; a truncated,
  corrupted, foreign or unloadable file is deleted and the kernel compiled by Numba
  (and stored afresh). Any failure of the cache falls back to Numba: the cache can make
  a first launch faster, never wrong, and never raise.
* **Not cached**: kernels without a registry identity (the ladder's, tests' own),
  kernels whose code needs more than their cubin to run (setup functions, objects kept
  alive, cooperative launches, debug builds, a shared-memory carveout), and everything
  in the simulator (which compiles nothing).

Where: ``$NUMBA_FLASH_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/numba_flash``, else
``~/.cache/numba_flash``. ``NUMBA_FLASH_CACHE=0`` turns the cache off. Both are read at
each use. A directory that cannot be written gives one warning
(:class:`KernelCacheWarning`) and the process goes on compiling as without a cache.
Deleting the directory (or :func:`clear`) empties the cache; entries of an older
environment are never read again, and stay until it is deleted.
"""
import hashlib
import json
import os
import struct
import sys
import tempfile
import threading
import types
import warnings

from ._runtime import SIMULATOR

ENV_DIR = "NUMBA_FLASH_CACHE_DIR"
ENV_SWITCH = "NUMBA_FLASH_CACHE"
SUFFIX = ".nfk"                       # one file per kernel and argument types
MAGIC = b"numba_flash kernel cache 1\n"
_DIGEST = 32                          # bytes of SHA-256
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_TAG = "_numba_flash_kernel"          # (name, identity) on a dispatcher, set by registry
_KEY = "_numba_flash_cache_key"       # the identity with the function's fingerprint (computed once)

# What the cache did in this process: kernels loaded from disk, stored, entries rejected
# (and deleted). Tests read it; so can a user wondering whether the cache works.
stats = {"loaded": 0, "stored": 0, "rejected": 0}

_lock = threading.Lock()
_warned = False
_modules = []          # (CUmodule, cubin) of every loaded entry: loaded for the process's life
_environments = {}     # device id -> environment()
_source_hash = None


class KernelCacheWarning(UserWarning):
    """The kernel cache's directory could not be written: kernels compile as without a cache."""


# --------------------------------------------------------------------------- where, whether
def directory() -> str:
    """The cache directory: ``$NUMBA_FLASH_CACHE_DIR``, ``$XDG_CACHE_HOME/numba_flash`` or
    ``~/.cache/numba_flash``."""
    found = os.environ.get(ENV_DIR)
    if found:
        return os.path.abspath(os.path.expanduser(found))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "numba_flash")


def enabled() -> bool:
    """Whether kernels are stored and loaded: on a GPU, unless ``NUMBA_FLASH_CACHE=0``."""
    return not SIMULATOR and os.environ.get(ENV_SWITCH, "1") != "0"


def info() -> dict:
    """``{"directory", "enabled", "entries", "bytes"}``: where the cache is, whether this
    process uses it, and the entries found there (of every environment)."""
    path, entries, size = directory(), 0, 0
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and e.is_file():
                    entries += 1
                    size += e.stat().st_size
    except OSError:
        pass
    return {"directory": path, "enabled": enabled(), "entries": entries, "bytes": size}


def clear() -> int:
    """Delete every entry in the cache directory (and temporary files over an hour old, left
    by a process killed while writing); returns how many files went. Safe while other
    processes use the cache: they compile what they miss."""
    import time
    removed, old = 0, time.time() - 3600
    try:
        with os.scandir(directory()) as it:
            names = [e.path for e in it if e.name.endswith(SUFFIX)
                     or e.name.startswith(".tmp-") and e.stat().st_mtime < old]
    except OSError:
        return 0
    for name in names:
        try:
            os.remove(name)
            removed += 1
        except OSError:
            pass
    return removed


def _warn_once(message):
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"numba_flash: {message}; kernels compile in each process as without a cache "
                      f"(set {ENV_DIR} to a writable directory, or {ENV_SWITCH}=0 to turn the cache off)",
                      KernelCacheWarning, stacklevel=3)


# --------------------------------------------------------------------------- keys
def tag(kern, name: str, identity):
    """Give a kernel dispatcher its cache identity: ``name`` (readable, e.g. the registry
    specialisation's) and ``identity``, whose ``repr`` says everything the factory built it
    from (the registry passes the frozen ``Specialisation``). The first tag stays (a
    factory's cache hands out the same dispatcher again)."""
    if getattr(kern, _TAG, None) is None:
        try:
            setattr(kern, _TAG, (name, identity))
        except AttributeError:
            pass
    return kern


def kernel_name(kern):
    """The name :func:`tag` gave ``kern``, or None."""
    found = getattr(kern, _TAG, None)
    return None if found is None else found[0]


def kernel_identity(kern):
    """The identity :func:`tag` gave ``kern`` (the registry's ``Specialisation``), or None."""
    found = getattr(kern, _TAG, None)
    return None if found is None else found[1]


def kernel_key(kern):
    """``kern``'s identity with its function's fingerprint, or None for an untagged kernel."""
    key = getattr(kern, _KEY, None)
    if key is None:
        found = getattr(kern, _TAG, None)
        if found is None:
            return None
        func = getattr(kern, "py_func", None)
        key = f"{found[0]}|{found[1]!r}|{function_fingerprint(func) if func is not None else ''}"
        setattr(kern, _KEY, key)
    return key


def function_fingerprint(func) -> str:
    """SHA-256 of a Python function's code (bytecode, names and constants, nested code
    included) and its closure: plain values by value, functions and dispatchers by their
    own fingerprint, anything else by type. The package's source hash already covers the
    code as written; this also tells apart kernels a factory built from different
    arguments, or that a test built from a patched factory, under one registry identity."""
    h = hashlib.sha256()
    _digest_function(func, h, set())
    return h.hexdigest()


def _digest_function(func, h, seen):
    if id(func) in seen:
        h.update(b"<seen>")
        return
    seen.add(id(func))
    code = getattr(func, "__code__", None)
    if code is None:
        h.update(type(func).__qualname__.encode())
        return
    _digest_code(code, h)
    for cell in func.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:          # an empty cell
            h.update(b"<empty>")
            continue
        _digest_value(value, h, seen)


def _digest_code(code, h):
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _digest_code(c, h)
        elif isinstance(c, frozenset):
            h.update(repr(sorted(repr(x) for x in c)).encode())
        else:
            h.update(repr(c).encode())


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _digest_value(value, h, seen):
    if isinstance(value, _PLAIN):
        h.update(f"{type(value).__qualname__}:{value!r}".encode())
    elif isinstance(value, tuple):
        h.update(b"(")
        for v in value:
            _digest_value(v, h, seen)
        h.update(b")")
    elif hasattr(value, "py_func"):              # a Numba dispatcher (device function, kernel)
        _digest_function(value.py_func, h, seen)
    elif isinstance(value, types.FunctionType):
        _digest_function(value, h, seen)
    elif isinstance(value, types.ModuleType):
        h.update(f"<module {value.__name__}>".encode())
    elif isinstance(value, type):
        h.update(f"<class {value.__module__}.{value.__qualname__}>".encode())
    elif isinstance(value, (set, frozenset)):
        h.update(repr(sorted(repr(v) for v in value)).encode())
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):    # a NumPy array or scalar
        h.update(f"{value.dtype.str}{getattr(value, 'shape', ())}".encode() + value.tobytes())
    else:       # by its repr (tilings, score rules, Numba types, dtypes) unless that holds an address
        text = repr(value)
        kind = f"<{type(value).__module__}.{type(value).__qualname__}>"
        h.update((kind if " at 0x" in text else kind + text).encode())


def argkey_text(argkey) -> str:
    """``launch``'s argument-types key as text: ``dtype:ndim:layout`` per array, the type's
    name per scalar."""
    parts = []
    for k in argkey:
        if isinstance(k, tuple):
            dtype, ndim, layout = k
            parts.append(f"{dtype}/{dtype.str}:{ndim}:{layout}")
        else:
            parts.append(f"{k.__module__}.{k.__qualname__}")
    return ",".join(parts)


def source_hash(root: str = PACKAGE_DIR) -> str:
    """SHA-256 of every ``.py`` file under ``root`` (paths and contents)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> tuple:
    """``(name, value)`` pairs of what, beside the kernel and its argument types, changes
    the compiled code on the current device (computed once per device)."""
    global _source_hash
    from numba import cuda
    dev = cuda.get_current_device()
    found = _environments.get(dev.id)
    if found is not None:
        return found
    from cuda.bindings import driver as cu
    if _source_hash is None:
        _source_hash = source_hash()
    err, drv = cu.cuDriverGetVersion()
    try:
        from numba.cuda.cudadrv import nvvm
        nvvm_version = tuple(nvvm.NVVM().get_version())
    except Exception:  # noqa: BLE001 - recorded as unknown: still a distinct key
        nvvm_version = None
    try:
        from cuda.bindings import nvjitlink
        link_version = tuple(nvjitlink.version())
    except Exception:  # noqa: BLE001
        link_version = None
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    options = {n: str(getattr(config, n, None)) for n in
               ("OPT", "DEBUGINFO_DEFAULT", "CUDA_DEBUGINFO_DEFAULT", "CUDA_ENABLE_NRT")}
    found = (("source", _source_hash), ("python", "%d.%d" % sys.version_info[:2]),
             ("numba", _version("numba")), ("numba-cuda", _version("numba-cuda")),
             ("llvmlite", _version("llvmlite")),
             ("cc", "%d.%d" % tuple(dev.compute_capability)),
             ("driver", drv if err == cu.CUresult.CUDA_SUCCESS else None),
             ("nvvm", nvvm_version), ("nvjitlink", link_version), ("numba options", options))
    _environments[dev.id] = found
    return found


def key_text(kernel: str, argkey, env) -> str:
    """The full key: the kernel's identity, its argument types and the environment."""
    return json.dumps({"kernel": kernel, "args": argkey if isinstance(argkey, str) else argkey_text(argkey),
                       "environment": [[str(n), str(v)] for n, v in env]}, sort_keys=True)


def entry_path(text: str, where: str = None) -> str:
    """The file of the entry with key text ``text`` in ``where`` (default :func:`directory`)."""
    return os.path.join(where or directory(), hashlib.sha256(text.encode()).hexdigest() + SUFFIX)


# --------------------------------------------------------------------------- entries
def write_entry(path: str, text: str, entry_name: str, params, cubin: bytes) -> bool:
    """Write an entry atomically (a temporary file in the same directory, then
    ``os.replace``). False, with one warning per process, if the directory cannot be written."""
    header = json.dumps({"key": text, "entry": entry_name, "params": list(params),
                         "size": len(cubin)}).encode()
    payload = struct.pack("<I", len(header)) + header + bytes(cubin)
    data = MAGIC + hashlib.sha256(payload).digest() + payload
    where = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=where)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass
        _warn_once(f"the kernel cache cannot write to {where} ({exc.strerror or exc})")
        return False


def read_entry(path: str, text: str):
    """``(entry name, parameter ctype names, cubin)`` of the entry at ``path`` for key text
    ``text``, or None: no such file, or one that fails a check (deleted)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        n = len(MAGIC)
        if data[:n] != MAGIC or len(data) < n + _DIGEST + 4:
            raise ValueError("not an entry, or truncated")
        digest, payload = data[n:n + _DIGEST], data[n + _DIGEST:]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum")
        size, = struct.unpack("<I", payload[:4])
        header = json.loads(payload[4:4 + size].decode())
        cubin = payload[4 + size:]
        if header["key"] != text or header["size"] != len(cubin) or not cubin:
            raise ValueError("another key")
        return str(header["entry"]), list(header["params"]), cubin
    except Exception:  # noqa: BLE001 - any malformed entry: gone, and compiled again
        discard(path)
        return None


def discard(path: str):
    """Delete a bad entry (counted in ``stats["rejected"]``)."""
    stats["rejected"] += 1
    try:
        os.remove(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- GPU side
def _params_text(ptypes):
    return [p.__name__ for p in ptypes]


def load(kern, argkey, ptypes):
    """The CUfunction of ``kern`` for these argument types from the cache, loaded into the
    current context, or None (no entry, cache off, untagged kernel, or a bad entry, which
    is deleted). ``ptypes``: the parameter ctypes ``launch`` passes; the entry must agree."""
    if not enabled():
        return None
    try:
        key = kernel_key(kern)
        if key is None:
            return None
        text = key_text(key, argkey, environment())
        path = entry_path(text)
        found = read_entry(path, text)
        if found is None:
            return None
        name, params, cubin = found
        if params != _params_text(ptypes):
            discard(path)
            return None
        func = _load_function(cubin, name)
        if func is None:
            discard(path)
            return None
        stats["loaded"] += 1
        return func
    except Exception:  # noqa: BLE001 - the cache never breaks a launch: Numba compiles
        return None


def forget(kern, argkey):
    """Delete the entry of ``kern`` for these argument types (one the driver loaded, then
    refused to launch): the next process compiles the kernel afresh."""
    try:
        key = kernel_key(kern)
        if key is not None:
            discard(entry_path(key_text(key, argkey, environment())))
    except Exception:  # noqa: BLE001
        pass


def _load_function(cubin, name):
    from cuda.bindings import driver as cu
    err, module = cu.cuModuleLoadData(cubin)
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    err, func = cu.cuModuleGetFunction(module, name.encode())
    if err != cu.CUresult.CUDA_SUCCESS:
        cu.cuModuleUnload(module)
        return None
    with _lock:
        _modules.append((module, cubin))
    return func


def cacheable(compiled) -> bool:
    """Whether a compiled kernel (Numba's ``_Kernel``) runs from its cubin alone."""
    lib = getattr(compiled, "_codelibrary", None)
    if lib is None or getattr(lib, "_entry_name", None) is None:
        return False
    return not (getattr(compiled, "debug", False) or getattr(compiled, "cooperative", False)
                or getattr(compiled, "shared_memory_carveout", None) is not None
                or getattr(compiled, "launch_config_sensitive", False)
                or getattr(lib, "_setup_functions", None) or getattr(lib, "_teardown_functions", None)
                or getattr(lib, "referenced_objects", None) or getattr(lib, "needs_cudadevrt", False))


def store(kern, argkey, compiled, ptypes) -> bool:
    """Write the cubin Numba compiled for ``kern`` and these argument types (``compiled``:
    its ``_Kernel``). False where the kernel is not cached or the write failed."""
    if not enabled() or not cacheable(compiled):
        return False
    try:
        key = kernel_key(kern)
        if key is None:
            return False
        lib = compiled._codelibrary
        cubin = lib.get_cubin()                # Numba's own, cached when it loaded the kernel
        cubin = getattr(cubin, "code", cubin)  # a cuda.core ObjectCode, or bytes
        if not isinstance(cubin, (bytes, bytearray, memoryview)):
            return False
        text = key_text(key, argkey, environment())
        if write_entry(entry_path(text), text, lib._entry_name, _params_text(ptypes), bytes(cubin)):
            stats["stored"] += 1
            return True
    except Exception:  # noqa: BLE001 - a kernel that cannot be stored is compiled next time
        pass
    return False
