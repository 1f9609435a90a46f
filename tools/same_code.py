"""Whether two numba_flash source trees compile the registry's kernels to the same machine
code (no GPU needed: NVVM, ptxas and nvdisasm)::

    python tools/same_code.py --rev HEAD~1 --rev HEAD --only forward_wgmma/ --cc 9.0
    python tools/same_code.py --rev main --tree . --only forward_mma/bfloat16/d128

A refactor whose kernels come out instruction for instruction the same needs no new
measurement; one whose code changes does (``tools/ab.py``). Each tree runs
``python -m numba_flash.ptx --ptxas --sass --out DIR`` with the tree first on
``PYTHONPATH``; the SASS instructions of each kernel are compared with the numbers Numba
puts in mangled names (which count compiles, not code) taken out. The PTX is not compared:
NVVM numbers virtual registers in the order it meets them, so two trees can differ there
and still assemble to the same machine code. Prints one line per kernel and exits 1 if
any differs or is missing from a tree. Needs ptxas and nvdisasm (``NVDISASM`` names the
latter; ``python -m numba_flash.ptx --help``).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import export_rev  # noqa: E402

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")
_MANGLED_COUNT = re.compile(r"B\d+v\d+B")


def instructions(sass: str):
    """The instruction texts of an nvdisasm listing, mangled names' counters removed."""
    return [_MANGLED_COUNT.sub("BvB", m.group(1).strip()) for line in sass.splitlines()
            for m in [_INSTRUCTION.search(line)] if m]


def compare(a: dict, b: dict):
    """``[(kernel file, verdict)]`` for two ``{file: sass}`` maps: "same", "differs from
    instruction k (x and y instructions)" or "only in one tree"."""
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows.append((name, "only in one tree"))
            continue
        x, y = instructions(a[name]), instructions(b[name])
        if x == y:
            rows.append((name, "same"))
        else:
            k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            rows.append((name, f"differs from instruction {k} ({len(x)} and {len(y)} instructions)"))
    return rows


def _sass_of(tree, out, args):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NUMBA_ENABLE_CUDASIM="0")
    cmd = [sys.executable, "-m", "numba_flash.ptx", "--cc", args.cc, "--ptxas", "--sass", "--out", out]
    if args.only:
        cmd += ["--only", args.only]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=out)
    found = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".sass"):
            with open(os.path.join(out, f)) as fh:
                found[f] = fh.read()
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", action="append", default=[], help="a git revision (give two trees in all)")
    p.add_argument("--tree", action="append", default=[], help="a directory holding numba_flash")
    p.add_argument("--only", default=None, help="substring filter on the kernel name (python -m numba_flash.ptx --list)")
    p.add_argument("--cc", default="9.0", help="compute capabilities, as numba_flash.ptx takes them (default 9.0)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = [export_rev(r, os.path.join(tmp, f"rev{i}")) for i, r in enumerate(args.rev)] + args.tree
        if len(trees) != 2:
            p.error("give two trees: --rev and/or --tree, twice in all")
        sass = []
        for i, tree in enumerate(trees):
            out = os.path.join(tmp, f"sass{i}")
            os.makedirs(out)
            sass.append(_sass_of(tree, out, args))
    if not sass[0] and not sass[1]:
        print("no SASS written: ptxas or nvdisasm not found (python -m numba_flash.ptx --sass)", file=sys.stderr)
        return 1
    rows = compare(*sass)
    for name, verdict in rows:
        print(f"{name:72s} {verdict}")
    return 0 if all(v == "same" for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
