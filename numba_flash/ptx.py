"""Compile every registered kernel specialisation to PTX, without a GPU.

    python -m numba_flash.ptx                   # one JSON line per kernel and cc (8.0 and 9.0)
    python -m numba_flash.ptx --list            # the kernels' names
    python -m numba_flash.ptx --only forward_mma/bfloat16/d64/full --out ptx/   # write its PTX
    python -m numba_flash.ptx --cc 9.0 --ladder # one JSON line per rung of numba_flash.ladder
    python -m numba_flash.ptx --cc 9.0 --ptxas  # ... plus registers and spills, from ptxas
    python -m numba_flash.ptx --cc 9.0 --sass   # ... plus the machine code's hot loops (nvdisasm)
    python -m numba_flash.ptx --cc 9.0a         # every kernel for sm_90a (the Hopper ones only compile there)

Kernels of a Hopper-only variant (``registry.Variant.arch`` "sm_90a": ``wgmma``, TMA,
mbarriers, ``setmaxnreg``) are built for 9.0a whenever 9.0 or 9.0a is asked for, and
skipped otherwise; each JSON line counts those instructions too.

No GPU is needed: NVVM comes from the ``numba-cuda[cu13]`` wheels. Numba's simulator
cannot compile, so where numba_flash would switch it on (no GPU) this command sets
``NUMBA_ENABLE_CUDASIM=0`` for itself (``main()`` called in a process that already
runs the simulator replaces that process with this command, the variable set). Each kernel goes through Numba's front end
once, and NVVM emits PTX for each compute capability asked for (:func:`compile_ptx`).
The test suite runs this in subprocesses and checks what each PTX contains. ``--out``
writes the PTX (a student's view of what their Python became). ``--ptxas`` needs a
CUDA toolkit's ``ptxas`` (on PATH, under ``CUDA_HOME``, or in ``/usr/local/cuda*``) and
reports what only the machine code shows: registers per thread and spills. ``--sass``
also disassembles it (``nvdisasm``, found the same way, or named by ``NVDISASM``; with
``--out`` the listing is written too) and reports each basic block that does the
arithmetic (16 or more FFMA, DFMA or HMMA): its instruction count, instructions per FMA
and the commonest opcodes. That ratio is what a kernel bound by instruction issue runs
at; it showed, for example, that ``cvt.rna.tf32`` compiles to three instructions and
that signed shared-memory indices cost about one more per load (ladder rungs 3 and 8).
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
        "st.global": ptx.count("st.global"),
        # stores through generic addresses (st.u32, st.f32, ...: arrays of any strides)
        "st.generic": len(re.findall(r"\sst\.(?:[usbf]\d+|v\d)", ptx)),
        "st.shared.v4": ptx.count("st.shared.v4"),
        "local": ptx.count(".local"),
        "f64": ptx.count(".f64"),
        "mma.sync": ptx.count("mma.sync"),
        "ldmatrix": ptx.count("ldmatrix"),
        "cp.async": ptx.count("cp.async.cg"),
        # those that ask L2 for the whole 128-byte line (ops.cp_async16: all of them)
        "cp.async.L2::128B": ptx.count("cp.async.cg.shared.global.L2::128B"),
        "cvt.rna.tf32": ptx.count("cvt.rna.tf32"),
        "bar.sync": ptx.count("bar.sync"),
        "tanh.approx.f32": ptx.count("tanh.approx.f32"),
        "rcp.approx.f32": ptx.count("rcp.approx.ftz.f32") + ptx.count("rcp.approx.f32"),
        "ex2.approx": ptx.count("ex2.approx"),
        "exp2_fma": ptx.count("0f4B400000"),       # ops.exp2_fma's rounding constant, 1.5 * 2**23
        "wgmma.mma_async": ptx.count("wgmma.mma_async"),
        "cp.async.bulk.tensor": ptx.count("cp.async.bulk.tensor"),
        "mbarrier": ptx.count("mbarrier."),
        "setmaxnreg": ptx.count("setmaxnreg"),
        # the registers a warp-specialised kernel's producers keep and its consumers take
        "setmaxnreg.dec": max(map(int, re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32 (\d+)", ptx)), default=0),
        "setmaxnreg.inc": max(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32 (\d+)", ptx)), default=0),
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


def assemble(ptx: str, cc, ptxas: str, nvdisasm: str = None, keep_sass: bool = False) -> dict:
    """Registers per thread, stack frame and spill bytes of a one-kernel PTX, from
    ``ptxas -v``; with ``nvdisasm``, also ``hot_blocks`` (:func:`hot_blocks` of its
    SASS). NVVM may write a newer PTX ISA version than this ptxas reads; the
    ``.version`` line is then lowered to the one ptxas names (the kernels use no newer
    instruction, or ptxas reports it). For a kernel with ``wgmma``, ``wgmma_serialized``:
    whether ptxas made each product wait for the one before (its warning C7513, e.g. when
    a branch or a non-wgmma instruction writes a product's registers while a chain is in
    flight: the tensor cores then idle between products). Returns {} if ptxas fails."""
    arch = f"sm_{cc[0]}{cc[1]}{''.join(cc[2:])}"      # (9, 0, "a") -> sm_90a
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
    if "wgmma.mma_async" in ptx:     # ptxas's C7513: it waited for each product (a chain broken)
        info["wgmma_serialized"] = "C7513" in proc.stderr or "instructions are serialized" in proc.stderr
    for m in _PTXAS_INFO.finditer(proc.stderr):
        if m.group(4):
            info["registers"] = int(m.group(4))
        else:
            info.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    if sass is not None:
        info["hot_blocks"] = hot_blocks(sass)
        if "wgmma.mma_async" in ptx:
            info["wgmma_operand_writes"] = len(wgmma_operand_writes(sass))
            info["exponentials_between_waits"] = exponentials_between_waits(sass)
        if keep_sass:
            info["sass"] = sass
    return info


_FMA_OPS = ("FFMA", "DFMA", "HMMA")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
# opcodes whose first register operand is not written (stores, barriers, compares into predicates)
_NO_DESTINATION = ("ST", "RED", "ATOM", "BRA", "BAR", "SYNCS", "CALL", "RET", "EXIT", "ISETP", "FSETP", "DSETP",
                   "HSETP", "PLOP3", "WARPGROUP", "UTMA", "ELECT", "NOP", "MEMBAR", "FENCE", "DEPBAR", "WARPSYNC")


def wgmma_operand_writes(sass: str) -> list:
    """Instructions of an ``nvdisasm`` listing that write a register an ``HGMMA`` reads as
    its A operand (four registers from the second operand: P from registers) before a
    ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` has waited for it, in listing order (branches not
    followed): ``[(address, instruction, address of the HGMMA)]``. Such a write races the
    product, which may read its registers until it completes; ptxas does not stop it when
    the PTX writes another register that it then maps onto the operand's (an H100 gave NaN:
    docs/performance.md item 97). Every registered Hopper kernel has none."""
    in_flight, found = {}, []
    for line in sass.splitlines():
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        address, text = int(m.group(1), 16), m.group(2).strip()
        body = re.sub(r"^@!?U?P\w+\s+", "", text)
        op = body.split()[0] if body else ""
        if op.startswith("HGMMA"):
            a = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", body)
            if a:
                in_flight.update((r, address) for r in range(int(a.group(1)), int(a.group(1)) + 4))
            continue
        if op.startswith("WARPGROUP.DEPBAR"):
            if body.split()[-1] in ("0x0", "0"):
                in_flight.clear()
            continue
        regs = re.findall(r"\bR(\d+)\b", body)
        if regs and not op.startswith(_NO_DESTINATION) and int(regs[0]) in in_flight:
            found.append((address, text, in_flight[int(regs[0])]))
    return found


def exponentials_between_waits(sass: str) -> list:
    """For each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` of an ``nvdisasm`` listing (a consumer
    waiting for S while the P V issued with it runs), the ``MUFU.EX2`` before the next
    ``WARPGROUP.DEPBAR.LE gsb0, 0x0``, in listing order: the softmax's exponentials that
    run while P V does (FlashAttention-3's intra-warpgroup overlap). 0 where ptxas issues
    the second wait first (docs/performance.md items 97-98)."""
    counts, open_ = [], False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE" in line:
            if line.rstrip().rstrip(";").split()[-1] == "0x1":
                counts.append(0)
                open_ = True
            else:
                open_ = False
        elif open_ and "MUFU.EX2" in line:
            counts[-1] += 1
    return counts


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


def compile_ptx(pyfunc, signature, ccs, launch_bounds=None):
    """{cc: PTX} of one kernel for each compute capability in ``ccs``.

    Numba's front end (typing, inlining, lowering to NVVM IR: about 80% of a compile) runs
    once and NVVM then emits PTX for each target: what Numba would lower for (8, 0) and
    (9, 0) is the same IR (its only target-dependent lowering, in atomics and ``tanh``, is
    decided at cc 6.0 and 7.5), so the PTX is the same as one ``cuda.compile_ptx`` per cc
    but for symbol names. This uses ``numba.cuda.compiler._compile_pyfunc_with_fixup``
    (numba-cuda 0.30.4, which is pinned), else falls back to a full compile per cc.
    """
    from numba import cuda
    from numba.cuda import compiler
    bounds = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
    one_front_end = getattr(compiler, "_compile_pyfunc_with_fixup", None)
    if one_front_end is None:
        return {cc: cuda.compile_ptx(pyfunc, signature, cc=cc, **bounds)[0] for cc in ccs}
    lib, _ = one_front_end(pyfunc, signature, device=False, cc=min(ccs), abi="numba", **bounds)
    return {cc: lib.get_asm_str(cc=cc) for cc in ccs}


def compile_spec(spec, ccs, layout="C"):
    """{cc: PTX} of a registered specialisation (see :func:`compile_ptx`)."""
    bounds = None if spec.tiling is None else (spec.tiling.threads, 1)
    return compile_ptx(spec.kernel().py_func, spec.signature(layout), ccs, bounds)


def compile_rung(rung, ccs):
    """{cc: PTX} of a ladder rung's kernel at its GPU tile sizes."""
    from .ladder import _host
    kern = rung.kernel(simulator=False)
    return compile_ptx(kern.py_func, _host.SIGNATURE, ccs, (kern.threads, 1))


def _file_stem(name, cc):
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.sm_{cc[0]}{cc[1]}{''.join(cc[2:])}"


def _parse_shard(text):
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, e.g. 0/2; got {text!r}")
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, e.g. 0/2; got {text!r}")
    return k, n


def _parse_ccs(text):
    try:
        ccs = tuple(_parse_cc(cc) for cc in text.split(","))
    except ValueError:
        ccs = ()
    if not ccs:
        raise argparse.ArgumentTypeError(f"expected compute capabilities like 9.0, 8.0,9.0 or 9.0a; got {text!r}")
    return ccs


def _parse_cc(text):
    """"8.0" -> (8, 0); "9.0a" -> (9, 0, "a") (the architecture-specific target)."""
    m = re.fullmatch(r"(\d+)\.(\d+)(a?)", text.strip())
    if not m:
        raise ValueError(text)
    return (int(m.group(1)), int(m.group(2))) + ((m.group(3),) if m.group(3) else ())


def _cc_name(cc):
    return f"{cc[0]}.{cc[1]}{''.join(cc[2:])}"


def spec_ccs(spec, ccs):
    """The compute capabilities among ``ccs`` to build ``spec`` for: all of them, except
    for a variant of ``arch`` "sm_90a" (Hopper instructions): 9.0a alone, if any of
    ``ccs`` is 9.0 or 9.0a, else none."""
    from . import registry
    if registry.VARIANTS[spec.variant].arch != "sm_90a":
        return list(ccs)
    return [(9, 0, "a")] if any(tuple(cc[:2]) == (9, 0) for cc in ccs) else []


EPILOG = """\
examples:
  python -m numba_flash.ptx --list                       # the specialisations' names
  python -m numba_flash.ptx --only forward_mma/bfloat16/d64/full --out ptx/
                          # write that kernel's PTX for sm_80 and sm_90 to ptx/*.ptx
  python -m numba_flash.ptx --cc 9.0 --ptxas --sass --only forward_simt/float32/d64/full/async --out ptx/
                          # ... plus registers/spills, and its SASS in ptx/*.sass
  python -m numba_flash.ptx --ladder --cc 8.0 --out ptx/  # the ladder's rungs

No GPU is needed: the kernels are compiled, not run. On a machine without a GPU
numba_flash would switch Numba's CUDA simulator on, which cannot compile, so this
command sets NUMBA_ENABLE_CUDASIM=0 for itself.
"""


def _ensure_compiler(argv):
    """Run this module again with NUMBA_ENABLE_CUDASIM=0 if numba came up in the simulator."""
    from ._runtime import SIMULATOR
    if SIMULATOR:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        args = [sys.executable, "-m", "numba_flash.ptx", *(sys.argv[1:] if argv is None else argv)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, args, env)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m numba_flash.ptx", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cc", default="8.0,9.0", type=_parse_ccs,
                   help="compute capabilities, comma-separated (default 8.0,9.0); one JSON line per kernel and cc")
    p.add_argument("--layout", default="C", choices=["C", "A"], help="array layout of q, k, v (default C)")
    p.add_argument("--only", default=None, help="substring filter on the kernel name (see --list)")
    p.add_argument("--list", action="store_true", help="print the kernels' names and exit (no compile)")
    p.add_argument("--ladder", action="store_true", help="compile the rungs of numba_flash.ladder instead")
    p.add_argument("--shard", default=(0, 1), type=_parse_shard, metavar="K/N",
                   help="compile only every N-th kernel, starting at the K-th (parallel runs)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write each kernel's PTX to DIR/<name>.sm_XY.ptx (and .sass with --sass)")
    p.add_argument("--ptxas", action="store_true",
                   help="also assemble each kernel with ptxas (if found): registers, stack, spills")
    p.add_argument("--sass", action="store_true",
                   help="with ptxas: also disassemble (nvdisasm, if found) and report the hot blocks and, "
                        "for Hopper kernels, writes to a product's register operand before its wait "
                        "(wgmma_operand_writes: a race; every registered kernel has none) and the softmax's "
                        "exponentials between a tile's two waits (exponentials_between_waits)")
    a = p.parse_args(argv)
    if a.list:
        from . import registry
        from .ladder import RUNGS
        names = [r.name for r in RUNGS] if a.ladder else [s.name for s in registry.specialisations()]
        print("\n".join(n for n in names if not a.only or a.only in n))
        return
    _ensure_compiler(argv)
    from . import registry
    ptxas = find_ptxas() if a.ptxas or a.sass else None
    if (a.ptxas or a.sass) and ptxas is None:
        print("numba_flash.ptx: no ptxas found (PATH, CUDA_HOME, /usr/local/cuda*): no register counts",
              file=sys.stderr)
    nvdisasm = find_tool("nvdisasm") if a.sass else None
    if a.sass and nvdisasm is None:
        print("numba_flash.ptx: no nvdisasm found (NVDISASM, PATH, CUDA_HOME, /usr/local/cuda*): no SASS",
              file=sys.stderr)
    if a.out:
        os.makedirs(a.out, exist_ok=True)

    def rows(name, ptxs, **extra):
        for cc, ptx in ptxs.items():
            r = {"name": name, "cc": _cc_name(cc), **extra, **features(ptx)}
            stem = os.path.join(a.out, _file_stem(name, cc)) if a.out else None
            if stem:
                with open(stem + ".ptx", "w") as f:
                    f.write(ptx)
            if ptxas:
                info = assemble(ptx, cc, ptxas, nvdisasm, keep_sass=bool(stem))
                sass = info.pop("sass", None)
                if stem and sass:
                    with open(stem + ".sass", "w") as f:
                        f.write(sass)
                r.update(info)
            print(json.dumps(r), flush=True)

    k, n = a.shard
    if a.ladder:
        from .ladder import RUNGS
        chosen = [rung for rung in RUNGS if not a.only or a.only in rung.name][k::n]
        for rung in chosen:
            rows(rung.name, compile_rung(rung, a.cc))
        return
    chosen = [s for s in registry.specialisations() if not a.only or a.only in s.name][k::n]
    if not chosen:
        sys.exit(f"numba_flash.ptx: no kernel matches --only {a.only!r} (see --list)")
    for spec in chosen:
        ccs = spec_ccs(spec, a.cc)
        if ccs:
            rows(spec.name, compile_spec(spec, ccs, a.layout), dtype=spec.dtype, layout=a.layout)


if __name__ == "__main__":
    main()
