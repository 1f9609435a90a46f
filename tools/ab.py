"""A/B of numba_flash source trees on one GPU: the same calls' kernels, timed alone, the
trees taking turns, each in its own process (a GPU machine)::

    python tools/ab.py --rev HEAD~1 --rev HEAD --shapes "4,16,4096,128,1;16,16,1024,128,0"
    python tools/ab.py --tree /tmp/a --tree /tmp/b --varlen --rounds 3 --json ab.json

``--rev`` exports a git revision's ``numba_flash`` (``git archive``) into a temporary
directory; ``--tree`` names a directory that holds a ``numba_flash`` package (on a GPU
machine whose copy of the project has no git history, export the trees beforehand:
``git archive REV numba_flash | tar -x -C DIR``). A tree may set module constants for
itself: ``--tree ".;kernels.forward_wgmma.EXP2_FMA_SOFTCAP=1"`` runs a copy of the
checkout's ``numba_flash`` whose ``kernels/forward_wgmma.py`` has the line
``EXP2_FMA_SOFTCAP = 1`` in place of its own (several ``;MODULE.NAME=VALUE`` may follow
a path; each must match one ``NAME = ...`` line at the module's top level), so an option
is measured against the default with no tree exported. A shape is
``B,H,N,d,causal`` (q, k and v of shape ``(B, H, N, d)``), with optional score rules after
it: ``w=L``, a sliding window of ``L`` keys before each query (``window=(L, 0)`` when
causal, else ``(L, L)``), ``c=C``, a softcap ``C`` (e.g. ``1,16,16384,128,1,w=1024`` or
``4,16,4096,128,0,c=30``), and ``t``: q, k and v token-major, ``(B, N, H, d)`` arrays
passed as ``(B, H, N, d)`` views (the layout a varlen batch's ``(tokens, H, d)`` rows
have; e.g. ``16,16,4096,128,1;16,16,4096,128,1,t`` times both layouts of one problem);
``--varlen`` adds the causal
varlen batch of ``bench.py serving`` (16 sequences of 256..4096 rows, 16 heads, d = 128),
or with ``--lens`` the sequence lengths given (``384*16``, ``100,3000,257``: comma-
separated, ``L*n`` for ``n`` sequences of ``L`` rows; repeated, a batch each: ``--lens ""``
is the serving batch) and with ``--varlen-heads H,d``
other heads and head dim; ``--decode`` adds the decoding
rows of ``bench.py serving`` (one query per sequence, 16 sequences of 8192 keys, 32 query
heads and 32 or 8 K/V heads, d = 128), the grouped row with 4 sequences and with one, and
one sequence of the MHA row, each with SDPA's cuDNN backend timed beside it in
the same process (the peer's time is the same code in every tree: a drift check);
``--backward`` times the backward's kernels too. Per round every tree runs once, in the
order given, in a fresh process whose ``sys.path`` starts with the tree and whose kernel
cache (``NUMBA_FLASH_CACHE_DIR``) is its own; in it each call is planned once
(``api.plan_forward`` / ``plan_backward``), run and checked against PyTorch's SDPA (max abs
error), then its launches are timed back to back with CUDA events (median of 7 repeats of
at least 20 calls and 10 ms of the host's queueing), each repeat's calls queued behind a
GPU sleep long enough to hold them all (``benchmarks/gpu_pace.py``): the time is the GPU's, not the
host's pace of launching (which bounds a call of a few microseconds of work). A varlen
call is timed whole, through the API, queued the same way (its host work, the same in
every tree unless a tree changes it, is hidden unless it outlasts the kernels). Prints, per call, each tree's times and its mean
against the first tree's, and whether every tree's results (out and lse) have the first
tree's bits (a hash of each call's results: ``same``, or the trees that differ, by their
place in the order given), and flags a tree whose results are not repeatable (a call's
results hashed before and after its timing, and in every round); ``--json`` keeps every
measurement.

A tree's process differs from the others only in the source it imports, so the ratios
measure the change; differences under about 0.5% are run-to-run noise on an H200
(docs/performance.md items 71-72).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project (benchmarks/)
VARLEN_LENS = tuple(int(256 + i * (4096 - 256) / 15) for i in range(16))


def parse_lens(text):
    """``"384*16,100"`` -> ``(384, ..., 384, 100)``: comma-separated lengths, ``L*n`` for ``n``
    sequences of ``L`` rows; ``""`` -> the serving batch (``VARLEN_LENS``)."""
    lens = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        length, _, count = part.partition("*")
        try:
            length, count = int(length), int(count or 1)
        except ValueError:
            raise ValueError(f"lengths {part!r}: expected L or L*n with whole numbers, e.g. 384*16") from None
        if length < 0 or count < 1:
            raise ValueError(f"lengths {part!r}: expected L >= 0 rows and n >= 1 sequences")
        lens += [length] * count
    return tuple(lens) or VARLEN_LENS


def parse_shapes(text):
    """``"B,H,N,d,causal[,w=L][,c=C][,t];..."`` -> ``[(B, H, N, d, causal, left, softcap,
    tokens), ...]`` (ints but the softcap; causal 0 or 1; ``left`` a window's keys before
    each query and ``softcap`` a float, None where not given; ``tokens`` True where ``t``
    asks for token-major inputs)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [f.strip() for f in part.split(",")]
        tokens = "t" in fields[5:]
        if tokens:
            fields.remove("t")
        rules = dict(f.split("=", 1) for f in fields[5:] if "=" in f)
        try:
            values = tuple(int(x) for x in fields[:5])
            left = int(rules.pop("w")) if "w" in rules else None
            cap = float(rules.pop("c")) if "c" in rules else None
        except ValueError:
            values, left, cap = (), None, None
        if (len(values) != 5 or values[4] not in (0, 1) or min(values[:4]) < 1 or rules
                or len(fields) - 5 != (left is not None) + (cap is not None)
                or left is not None and left < 0 or cap is not None and not cap > 0):
            raise ValueError(f"shape {part!r}: expected B,H,N,d,causal with positive sizes and causal 0 or 1, then "
                             "optionally w=L (a window, L >= 0), c=C (a softcap, C > 0) and t (token-major)")
        shapes.append(values + (left, cap, tokens))
    return shapes


def _reference(q, k, v, causal, left, cap, rows, torch):
    """The output of the last ``rows`` queries in float32 (scores of those rows only: the
    whole N x N would not fit at large N), with the window of ``left`` keys and the softcap
    ``cap`` where given."""
    n = q.shape[2]
    s = (q[:, :, n - rows:].float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(n - rows, n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    seen = torch.ones_like(s, dtype=torch.bool)
    if causal:
        seen = seen & (j <= i)
    if left is not None:
        seen = seen & (j >= i - left) & (j <= i + left)
    return torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v.float()


def summarise(records, trees):
    """Lines of a table from the workers' records: per call, each tree's median times
    (one per round) and the mean of its rounds against the first tree's."""
    calls = list(dict.fromkeys(r["call"] for r in records))
    lines = [f"{'call':36s} " + " ".join(f"{t:>26s}" for t in trees) + "  bits"]
    for call in calls:
        means = {}
        cells = []
        for t in trees:
            ms = [r["ms"] for r in records if r["call"] == call and r["tree"] == t]
            means[t] = sum(ms) / len(ms) if ms else None
            change = "" if t == trees[0] or not ms or not means[trees[0]] else f" ({means[t] / means[trees[0]] - 1:+.1%})"
            cells.append(f"{'/'.join(f'{x:.4f}' for x in ms) + change:>26s}")
        mine = [r for r in records if r["call"] == call]
        digests = {t: {r.get("bits") for r in mine if r["tree"] == t} for t in trees}
        same = [t for t in trees[1:] if digests[t] == digests[trees[0]] and len(digests[t]) == 1]
        bits = "n/a" if None in digests[trees[0]] else "same" if len(same) == len(trees) - 1 else (
            "differ: " + ", ".join(str(trees.index(t)) for t in trees[1:] if t not in same))
        # a tree whose own results changed: between its first and last call in one process, or
        # between rounds (its processes)
        unstable = [str(i) for i, t in enumerate(trees)
                    if len(digests[t]) > 1 or any(r.get("first", r.get("bits")) != r.get("bits")
                                                  for r in mine if r["tree"] == t)]
        if unstable and bits != "n/a":
            bits += "; NOT REPEATABLE in " + ", ".join(unstable)
        lines.append(f"{call:36s} " + " ".join(cells) + f"  {bits}")
    return lines


def _as_torch(x, torch):
    if isinstance(x, torch.Tensor):
        return x
    import numpy as np
    host = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
    return torch.from_numpy(host.view(np.int16) if host.dtype.itemsize == 2 else host).view(
        {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(host.dtype), torch.float32)).cuda()


def _digest(arrays, torch):
    """A short hash of the arrays' bits (the same in two trees: the same results, bit for bit)."""
    import hashlib
    h = hashlib.sha1()
    for x in arrays:
        t = _as_torch(x, torch).contiguous()
        h.update(t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def worker(tree, args):
    """One tree's measurements, in this process (``--worker``)."""
    sys.path.insert(0, os.path.abspath(tree))
    sys.path.append(ROOT)                   # (after the tree: its numba_flash is the one imported)
    import torch
    import numba_flash
    from numba_flash import api
    from numba_flash.launch import launch
    from benchmarks.gpu_pace import gpu_pace_ms
    assert os.path.abspath(numba_flash.__file__).startswith(os.path.abspath(tree)), numba_flash.__file__
    _time = lambda fn: gpu_pace_ms(fn, torch)  # noqa: E731
    dt = getattr(torch, args.dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    records = []
    for B, H, N, d, causal, left, cap, tokens in parse_shapes(args.shapes):
        q, k, v, dout = shape_inputs(B, H, N, d, tokens, dt, torch, count=4)
        window = None if left is None else (left, 0 if causal else left)
        result, launches = api.plan_forward(q, k, v, causal=bool(causal), window=window, softcap=cap)
        for a in launches:
            launch(*a)
        out, lse = result()
        if window is None and cap is None:
            err = (_as_torch(out, torch).float() - sdpa(q, k, v, is_causal=bool(causal)).float()).abs().max().item()
        else:
            rows = min(N, 256)
            ref = _reference(q, k, v, causal, left, cap, rows, torch)
            err = (_as_torch(out, torch)[:, :, N - rows:].float() - ref).abs().max().item()
        name = (f"fwd ({B},{H},{N},{d}){' causal' if causal else ''}{'' if left is None else f' window {left}'}"
                f"{'' if cap is None else f' softcap {cap:g}'}{' token-major' if tokens else ''}")
        first = _digest([out, lse], torch)
        records.append(dict(call=name, ms=_time(lambda: [launch(*a) for a in launches]), err=err,
                            first=first, bits=_digest([out, lse], torch)))
        if args.backward:
            result, launches = api.plan_backward(dout, q, k, v, _as_torch(out, torch), _as_torch(lse, torch),
                                                 causal=bool(causal), window=window, softcap=cap)
            records.append(dict(call="bwd" + name[3:],
                                ms=_time(lambda: [launch(*a) for a in launches]), err=None))
    if args.decode:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for b, hkv in ((16, 32), (16, 8), (4, 8), (1, 8), (1, 32)):
            torch.manual_seed(0)
            q = torch.randn(b, 32, 1, 128, device="cuda", dtype=dt)
            k, v = (torch.randn(b, hkv, 8192, 128, device="cuda", dtype=dt) for _ in range(2))
            result, launches = api.plan_forward(q, k, v)
            for a in launches:
                launch(*a)
            out, _ = result()
            first = _digest([out], torch)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                peer = lambda: sdpa(q, k, v, enable_gqa=hkv < 32)  # noqa: E731
                err = (_as_torch(out, torch).float() - peer().float()).abs().max().item()
                name = f"decode ({b},32/{hkv},8192,128)"
                records.append(dict(call=name, ms=_time(lambda: [launch(*a) for a in launches]), err=err,
                                    first=first, bits=_digest([out], torch)))
                records.append(dict(call=name + " cuDNN", ms=_time(peer), err=None))
    for text in (args.lens or [""]) if args.varlen else ():
        given = parse_lens(text)
        lens = torch.tensor(given)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).numpy()
        heads, d = (int(x) for x in args.varlen_heads.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(int(cu[-1]), heads, d, device="cuda", dtype=dt) for _ in range(3))
        call = lambda: numba_flash.attention_varlen(q, k, v, cu, cu, causal=True)  # noqa: E731
        s = next((i for i, n in enumerate(given) if n), None)         # a sequence with rows, checked
        rows = slice(int(cu[s]), int(cu[s + 1])) if s is not None else slice(0, 0)
        ref = sdpa(*(x[rows].transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
        got = call()
        err = (_as_torch(got, torch)[rows].float() - ref.float()).abs().max().item() if s is not None else 0.0
        name = "16 x 256..4096" if given == VARLEN_LENS else f"{len(given)} x {min(given)}..{max(given)}"
        name += "" if (heads, d) == (16, 128) else f", {heads} heads, d = {d}"
        records.append(dict(call=f"varlen {name} causal", ms=_time(call), err=err, first=_digest([got], torch),
                            bits=_digest([call()], torch)))
    return records


def shape_inputs(B, H, N, d, tokens, dt, torch, count=3):
    """``count`` random ``(B, H, N, d)`` CUDA tensors of dtype ``dt`` for a shape of
    :func:`parse_shapes` (seed 0): with ``tokens`` views of ``(B, N, H, d)`` arrays."""
    torch.manual_seed(0)
    if tokens:
        return tuple(torch.randn(B, N, H, d, device="cuda", dtype=dt).transpose(1, 2) for _ in range(count))
    return tuple(torch.randn(B, H, N, d, device="cuda", dtype=dt) for _ in range(count))


def with_constants(spec, into):
    """``spec`` = ``"PATH;MODULE.NAME=VALUE;..."``: a copy of PATH's ``numba_flash`` under
    ``into`` with each named top-level constant set (the line ``NAME = ...`` of
    ``numba_flash/MODULE.py``, dots as folders, replaced by ``NAME = VALUE``); a PATH alone
    is returned as it is."""
    import re
    import shutil
    path, *sets = [s.strip() for s in spec.split(";")]
    if not sets:
        return path
    shutil.copytree(os.path.join(path, "numba_flash"), os.path.join(into, "numba_flash"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for item in sets:
        module, name, value = _assignment(item)
        if not (module and name.isidentifier() and value):
            raise ValueError(f"tree {spec!r}: {item!r} is not MODULE.NAME=VALUE (e.g. kernels.forward_wgmma.X=True)")
        source = os.path.join(into, "numba_flash", *module.split(".")) + ".py"
        text = open(source).read()
        line = re.compile(rf"^{re.escape(name)} = .*$", re.M)
        if len(line.findall(text)) != 1:
            raise ValueError(f"tree {spec!r}: numba_flash/{module.replace('.', '/')}.py has "
                             f"{len(line.findall(text))} lines '{name} = ...', expected one")
        with open(source, "w") as f:
            f.write(line.sub(lambda m: f"{name} = {value}", text))
    return into


def set_constants(items):
    """Each ``MODULE.NAME=VALUE`` of ``items`` set in this process: ``numba_flash.MODULE``'s
    ``NAME`` to the Python literal ``VALUE`` (kernels built after it see it)."""
    import ast
    import importlib
    for item in items:
        module, name, value = _assignment(item)
        mod = importlib.import_module(f"numba_flash.{module}") if module else None
        if mod is None or not hasattr(mod, name) or not value:
            raise SystemExit(f"--set {item!r}: not MODULE.NAME=VALUE of a numba_flash constant")
        setattr(mod, name, ast.literal_eval(value))


def _assignment(item):
    """``"MODULE.NAME=VALUE"`` as ``(MODULE, NAME, VALUE)``, stripped ('' for a part left out)."""
    target, _, value = item.partition("=")
    module, _, name = target.strip().rpartition(".")
    return module, name, value.strip()


def export_rev(rev, into):
    """``numba_flash`` of git revision ``rev`` under ``into`` (a new directory)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", root, "archive", rev, "numba_flash"], capture_output=True, check=True)
    os.makedirs(into)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rev", action="append", default=[], help="a git revision to measure (repeatable)")
    p.add_argument("--tree", action="append", default=[], help="a directory holding numba_flash (repeatable)")
    p.add_argument("--shapes", default="", help='calls "B,H,N,d,causal[,w=L][,c=C];..." (q, k, v of shape '
                   '(B, H, N, d); w: a sliding window of L keys before each query, c: a softcap)')
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--varlen", action="store_true", help="add the causal varlen batch of bench.py serving")
    p.add_argument("--lens", action="append", default=[],
                   help='with --varlen: its sequence lengths, e.g. "384*16" or "100,3000" (repeatable: a batch each)')
    p.add_argument("--varlen-heads", default="16,128", help='with --varlen: "H,d", heads and head dim')
    p.add_argument("--decode", action="store_true", help="add bench.py serving's decoding rows (MHA, GQA)")
    p.add_argument("--backward", action="store_true", help="time the backward's kernels too")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    parse_shapes(args.shapes)
    for text in args.lens:
        parse_lens(text)
    if args.worker:
        print("\n" + json.dumps(worker(args.worker, args)))     # the last line: the parent reads it
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        trees = {f"rev {r}": export_rev(r, os.path.join(tmp, f"rev{i}")) for i, r in enumerate(args.rev)}
        trees.update({f"tree {t}": with_constants(t, os.path.join(tmp, f"tree{i}")) for i, t in enumerate(args.tree)})
        if len(trees) < 1 or not (args.shapes or args.varlen or args.decode):
            p.error("give at least one --rev or --tree, and --shapes, --varlen or --decode")
        names = list(trees)
        records = []
        for rnd in range(args.rounds):
            for name, path in trees.items():
                env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=os.path.join(tmp, "cache", str(names.index(name))))
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", path] + (argv or sys.argv[1:])
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode:
                    sys.stderr.write(proc.stderr)
                    return proc.returncode
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                records += [dict(r, tree=name, round=rnd) for r in got]
                print(f"round {rnd + 1}, {name}: " + ", ".join(f"{r['call']} {r['ms']:.4f} ms" for r in got),
                      flush=True)
    print("\n".join(summarise(records, names)))
    worst = max((r["err"] for r in records if r["err"] is not None), default=None)
    if worst is not None:
        print(f"largest error against SDPA: {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
