"""``python -m numba_flash``: what a bug report needs, printed.

The GPU (or the simulator), its compute capability and driver, the versions of
numba_flash and what it runs on, the environment variables that change its behaviour,
the on-disk kernel cache (where, whether it is used, its size) and which kernel family
each kind of call gets on this device. Nothing is compiled.
"""
import os
import platform
import sys
from importlib import metadata

PACKAGES = ("numba", "numba-cuda", "llvmlite", "numpy", "cuda-bindings", "ml_dtypes", "greenlet", "torch", "cupy",
            "jax")
ENV = ("NUMBA_ENABLE_CUDASIM", "NUMBA_FLASH_SIMULATOR_THREADS", "NUMBA_FLASH_HOPPER", "NUMBA_FLASH_SHARED_SCOPE_COPIES",
       "NUMBA_FLASH_FAST_ANALYSIS", "NUMBA_FLASH_GC_PAUSE", "NUMBA_FLASH_DEFER_ML_DTYPES",
       "NUMBA_FLASH_CACHE",
       "NUMBA_FLASH_CACHE_DIR", "CUDA_VISIBLE_DEVICES")


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _device():
    """``(lines, cc, sm_count)`` of the current device (the simulator's: no cc)."""
    from numba import cuda

    from ._runtime import SIMULATOR
    if SIMULATOR:
        from . import _simulator
        mode = ("greenlets, one OS thread taking a block's threads in turn" if _simulator.COOPERATIVE else
                "an OS thread per GPU thread" + ("" if _simulator._greenlet is not None else
                                                 " (greenlet is not installed)"))
        return ["device: none: Numba's CUDA simulator runs the kernels (correct, slow: tiny inputs)",
                f"simulator: {mode}"], None, 1
    dev = cuda.get_current_device()
    cc = tuple(dev.compute_capability)
    lines = [f"device: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, compute capability "
             f"{cc[0]}.{cc[1]}, {dev.MULTIPROCESSOR_COUNT} SMs, "
             f"{dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN // 1024} KiB shared memory per block"]
    try:
        from cuda.bindings import driver as cu
        err, ver = cu.cuDriverGetVersion()
        if err == cu.CUresult.CUDA_SUCCESS:
            lines.append(f"driver: CUDA {ver // 1000}.{ver % 1000 // 10}")
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        lines.append(f"driver: unknown ({type(exc).__name__}: {exc})")
    return lines, cc, dev.MULTIPROCESSOR_COUNT


def _families(cc):
    """Which kernel family each kind of call gets here (``registry``'s choices)."""
    from . import registry
    from .scores import FULL
    rows = []
    for dt in registry.DTYPES + registry.LOW_DTYPES:
        fwd = registry.forward_specialisation(dt, 128 if dt in registry.LOW_DTYPES else 64, FULL, True, cc=cc)
        line = f"  {dt:9s} forward {fwd.variant}"
        if fwd.variant == "forward_wgmma":
            line += " (multiples of 8 from 64 to 256; other d: forward_mma)"
        if dt in registry.LOW_DTYPES:
            dec = registry.forward_specialisation(dt, 128, FULL, True, cc=cc, rows=1)
            line += f", decoding (<= {registry.SPLIT_ROWS} query rows) {dec.variant}"
        back = "backward_dkdv_mma + backward_dq_mma" if dt in registry.LOW_DTYPES else (
            "backward_dkdv_simt + backward_dq_simt")
        if dt in registry.LOW_DTYPES and registry.uses_hopper(dt, 128, cc, variant="backward_dkdv_wgmma"):
            back = ("backward_dkdv_wgmma + backward_dq_wgmma (d 64 and 128; multiples of 8 between where forced; "
                    "others: backward_*_mma)")
        rows.append(f"{line}, backward {back}")
    return rows


def _kernel_cache_line():
    """Where the on-disk kernel cache is, whether it is used here, what it holds."""
    from . import _kernel_cache
    from ._runtime import SIMULATOR
    found = _kernel_cache.info()
    if found["enabled"]:
        state = "on"
    elif SIMULATOR:
        state = "off (the simulator compiles nothing)"
    else:
        state = f"off ({_kernel_cache.ENV_SWITCH}=0)"
    return (f"kernel cache (compiled kernels on disk): {state}; {found['entries']} entries, "
            f"{found['bytes'] / 2**20:.1f} MiB in {found['directory']} ({_kernel_cache.ENV_DIR} moves it, "
            f"{_kernel_cache.ENV_SWITCH}=0 turns it off)")


def report() -> str:
    """The report, as text."""
    import numba_flash
    from . import _fast_analysis, _inline_copies, registry
    lines = [f"numba_flash {numba_flash.__version__} ({os.path.dirname(numba_flash.__file__)})",
             f"python {sys.version.split()[0]} on {platform.platform()}"]
    lines += [f"{name} {_version(name)}" for name in PACKAGES if _version(name)]
    device, cc, _ = _device()
    lines += device
    lines.append(f"Hopper family choice: {registry.hopper_choice()} (NUMBA_FLASH_HOPPER)")
    fast = _inline_copies._installed and bool(_fast_analysis._originals)
    lines.append("faster kernel compiles (numba_flash._inline_copies, _fast_analysis): "
                 + ("on" if fast else "off" + (" (the simulator compiles nothing)" if numba_flash.SIMULATOR else "")))
    lines.append(_kernel_cache_line())
    lines.append("environment: " + (", ".join(f"{n}={os.environ[n]}" for n in ENV if n in os.environ) or "none set"))
    lines.append("kernels for this device (head dim 128 for 16-bit, 64 otherwise):")
    lines += _families(cc)
    return "\n".join(lines)


def main():
    print(report())


if __name__ == "__main__":
    main()
