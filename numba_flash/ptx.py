"""Compile every registered kernel specialisation to PTX, without a GPU.

    python -m numba_flash.ptx --cc 9.0          # one JSON line per specialisation
    python -m numba_flash.ptx --cc 9.0 --ladder # one JSON line per rung of numba_flash.ladder
    python -m numba_flash.ptx --cc 9.0 --ptxas  # ... plus registers and spills, from ptxas
    python -m numba_flash.ptx --cc 9.0 --sass   # ... plus the machine code's hot loops (nvdisasm)

Must run with ``NUMBA_ENABLE_CUDASIM=0`` (the simulator cannot compile); NVVM comes
from the ``numba-cuda[cu13]`` wheels, so no GPU or CUDA toolkit is needed. The test
suite runs this in a subprocess and checks what each PTX contains. ``--ptxas`` needs a
CUDA toolkit's ``ptxas`` (on PATH, under ``CUDA_HOME``, or in ``/usr/local/cuda*``) and
reports what only the machine code shows: registers per thread and spills. ``--sass``
also disassembles it (``nvdisasm``, found the same way, or named by ``NVDISASM``) and
reports each basic block that does the arithmetic (16 or more FFMA, DFMA or HMMA): its
instruction count, instructions per FMA and the commonest opcodes. That ratio is what a
kernel bound by instruction issue runs at; it showed, for example, that ``cvt.rna.tf32``
compiles to three instructions and that signed shared-memory indices cost about one
more per load (ladder rungs 3 and 8).
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


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


def find_tool(name):
    """Path of a CUDA toolkit executable (``ptxas``, ``nvdisasm``): the environment variable
    of its name in capitals, PATH, ``CUDA_HOME/bin`` or ``/usr/local/cuda*/bin``; or None."""
    named = os.environ.get(name.upper())
    if named and os.access(named, os.X_OK):
        return named
    found = shutil.which(name)
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", "")] + sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for root in roots:
        path = os.path.join(root, "bin", name)
        if root and os.access(path, os.X_OK):
            return path
    return None


def find_ptxas():
    """Path of a ``ptxas`` executable, or None."""
    return find_tool("ptxas")


_PTXAS_INFO = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                         r"|Used (\d+) registers")


def assemble(ptx: str, cc, ptxas: str, nvdisasm: str = None) -> dict:
    """Registers per thread, stack frame and spill bytes of a one-kernel PTX, from
    ``ptxas -v``; with ``nvdisasm``, also ``hot_blocks`` (:func:`hot_blocks` of its
    SASS). NVVM may write a newer PTX ISA version than this ptxas reads; the
    ``.version`` line is then lowered to the one ptxas names (the kernels use no newer
    instruction, or ptxas reports it). Returns {} if ptxas fails."""
    arch = f"sm_{cc[0]}{cc[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", dst], capture_output=True, text=True)
            newest = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", proc.stderr)
            if proc.returncode == 0 or not newest:
                break
            ptx = re.sub(r"^\.version [\d.]+", f".version {newest.group(1)}", ptx, count=1, flags=re.M)
        sass = None
        if proc.returncode == 0 and nvdisasm:
            dis = subprocess.run([nvdisasm, "-c", dst], capture_output=True, text=True)
            sass = dis.stdout if dis.returncode == 0 else None
    if proc.returncode != 0:
        return {}
    info = {}
    for m in _PTXAS_INFO.finditer(proc.stderr):
        if m.group(4):
            info["registers"] = int(m.group(4))
        else:
            info.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    if sass is not None:
        info["hot_blocks"] = hot_blocks(sass)
    return info


_FMA_OPS = ("FFMA", "DFMA", "HMMA")


def hot_blocks(sass: str, min_fma: int = 16) -> list:
    """The basic blocks of an ``nvdisasm -c`` listing that hold at least ``min_fma`` FFMA,
    DFMA or HMMA instructions: per block its instruction count, FMA count, instructions
    per FMA and its six commonest opcodes (without modifiers; predicates ignored)."""
    blocks, current = [], []
    for line in sass.splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            blocks.append(current)
            current = []
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            current.append(m.group(1))
    blocks.append(current)
    found = []
    for ops in blocks:
        counts = {}
        for op in ops:
            counts[op] = counts.get(op, 0) + 1
        fma = sum(counts.get(op, 0) for op in _FMA_OPS)
        if fma >= min_fma:
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
            found.append({"instructions": len(ops), "fma": fma, "per_fma": round(len(ops) / fma, 2),
                          "mix": dict(top)})
    return found


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
    p.add_argument("--ptxas", action="store_true",
                   help="also assemble each kernel with ptxas (if found): registers, stack, spills")
    p.add_argument("--sass", action="store_true",
                   help="with --ptxas: also disassemble (nvdisasm, if found) and report the hot blocks")
    a = p.parse_args(argv)
    from ._runtime import SIMULATOR
    if SIMULATOR:
        sys.exit("numba_flash.ptx: run with NUMBA_ENABLE_CUDASIM=0 (the simulator cannot compile PTX)")
    from . import registry
    cc = tuple(int(x) for x in a.cc.split("."))
    ptxas = find_ptxas() if a.ptxas or a.sass else None
    if (a.ptxas or a.sass) and ptxas is None:
        print("numba_flash.ptx: no ptxas found (PATH, CUDA_HOME, /usr/local/cuda*): no register counts",
              file=sys.stderr)
    nvdisasm = find_tool("nvdisasm") if a.sass else None
    if a.sass and nvdisasm is None:
        print("numba_flash.ptx: no nvdisasm found (NVDISASM, PATH, CUDA_HOME, /usr/local/cuda*): no SASS",
              file=sys.stderr)

    def row(name, ptx, **extra):
        r = {"name": name, "cc": a.cc, **extra, **features(ptx)}
        if ptxas:
            r.update(assemble(ptx, cc, ptxas, nvdisasm))
        print(json.dumps(r), flush=True)

    if a.ladder:
        from .ladder import RUNGS
        for rung in RUNGS:
            if not a.only or a.only in rung.name:
                row(rung.name, compile_rung(rung, cc))
        return
    for spec in registry.specialisations():
        if not a.only or a.only in spec.name:
            row(spec.name, compile_spec(spec, cc, a.layout), dtype=spec.dtype, layout=a.layout)


if __name__ == "__main__":
    main()
