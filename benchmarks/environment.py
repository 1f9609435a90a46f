"""The environment record every JSON starts with: date, GPU, git commit, versions."""
import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

import numpy as np

import numba_flash  # first: decides GPU vs simulator before numba is imported
from numba_flash import SIMULATOR

from numba import cuda  # noqa: E402  (after numba_flash, see above)

from .harness import input_kind

ROOT = Path(__file__).resolve().parents[1]


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


