"""Compile every registered kernel specialisation to PTX, without a GPU.

    python -m numba_flash.ptx --cc 9.0          # one JSON line per specialisation
    python -m numba_flash.ptx --cc 9.0 --ladder # one JSON line per rung of numba_flash.ladder

Must run with ``NUMBA_ENABLE_CUDASIM=0`` (the simulator cannot compile); NVVM comes
from the ``numba-cuda[cu13]`` wheels, so no GPU or CUDA toolkit is needed. The test
suite runs this in a subprocess and checks what each PTX contains.
"""
import argparse
import json
import sys


def features(ptx: str) -> dict:
    """Instructions the tests look for in a kernel's PTX."""
    return {
        "shfl.sync": ptx.count("shfl.sync"),
        "ld.shared.v4": ptx.count("ld.shared.v4"),
        "ld.global.v4": ptx.count("ld.global.v4"),
        "st.shared.v4": ptx.count("st.shared.v4"),
        "local": ptx.count(".local"),
        "f64": ptx.count(".f64"),
        "mma.sync": ptx.count("mma.sync"),
        "ldmatrix": ptx.count("ldmatrix"),
        "cp.async": ptx.count("cp.async.cg"),
        "cvt.rna.tf32": ptx.count("cvt.rna.tf32"),
        "bar.sync": ptx.count("bar.sync"),
    }


def compile_spec(spec, cc, layout="C"):
    from numba import cuda
    kern = spec.kernel()
    bounds = {} if spec.tiling is None else {"launch_bounds": (spec.tiling.threads, 1)}
    ptx, _ = cuda.compile_ptx(kern.py_func, spec.signature(layout), cc=cc, **bounds)
    return ptx


def compile_rung(rung, cc):
    """PTX of a ladder rung's kernel at its GPU tile sizes."""
    from numba import cuda
    from .ladder import _host
    kern = rung.kernel(simulator=False)
    ptx, _ = cuda.compile_ptx(kern.py_func, _host.SIGNATURE, cc=cc, launch_bounds=(kern.threads, 1))
    return ptx


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", default="9.0", help="compute capability, e.g. 8.0 or 9.0")
    p.add_argument("--layout", default="C", choices=["C", "A"], help="array layout of q, k, v")
    p.add_argument("--only", default=None, help="substring filter on the specialisation name")
    p.add_argument("--ladder", action="store_true", help="compile the rungs of numba_flash.ladder instead")
    a = p.parse_args(argv)
    from ._runtime import SIMULATOR
    if SIMULATOR:
        sys.exit("numba_flash.ptx: run with NUMBA_ENABLE_CUDASIM=0 (the simulator cannot compile PTX)")
    from . import registry
    cc = tuple(int(x) for x in a.cc.split("."))
    if a.ladder:
        from .ladder import RUNGS
        for rung in RUNGS:
            if a.only and a.only not in rung.name:
                continue
            ptx = compile_rung(rung, cc)
            print(json.dumps({"name": rung.name, "cc": a.cc, **features(ptx)}), flush=True)
        return
    for spec in registry.specialisations():
        name = spec.name
        if a.only and a.only not in name:
            continue
        ptx = compile_spec(spec, cc, a.layout)
        print(json.dumps({"name": name, "dtype": spec.dtype, "cc": a.cc, "layout": a.layout,
                          **features(ptx)}), flush=True)


if __name__ == "__main__":
    main()
