"""Regenerate the generated parts of docs/ladder.md from the rung files (and a bench run).

    python docs/gen_ladder.py                                     # rungs and overview from the code
    python docs/gen_ladder.py --results results/bench-ladder.json # ... and the measured table + chart,
                                                                  # and each rung's "Measured" paragraph
    python docs/gen_ladder.py --check                             # exit 1 if ladder.md is stale (a test)

docs/ladder.md is hand-written except for the blocks between
``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``:

* ``overview``: one table row per rung of ``numba_flash.ladder.RUNGS``;
* ``rungs``: per rung, its module docstring and its key code, cut from the rung file
  between the anchor lines listed in ``FRAGMENTS`` below (so the doc cannot drift from
  the code; anchors match code only, never a docstring);
* ``predictions``: each rung's prediction and verdict (``PREDICTIONS`` below) next to
  what it measured, read from the rung's "Measured" docstring paragraph: one source for
  every figure, so the Results table and this one cannot disagree;
* ``results``: the table ``python bench.py ladder`` measured, rendered from its JSON,
  and its bar chart (copied next to this file). Left as it is without ``--results``.

With ``--results`` the "Measured" paragraph of each rung's docstring is rewritten too,
from the same JSON: the numbers in the rung files are never typed by hand.
"""
import argparse
import ast
import importlib.util
import re
import shutil
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ladder.md"
CHART = ROOT / "docs" / "ladder.png"
sys.path.insert(0, str(ROOT))

# Per rung: (caption, first line containing ..., last line containing ...[, another file]), cut from
# the rung's file (or that file, shown as text).
FRAGMENTS = {
    1: [("the score: a d-long dot product per thread, straight from global memory",
         "# S_ij = Q_i K_jᵀ · scale", "x = acc * scale_log2"),
        ("the row max: a tree in shared memory, one barrier per level",
         "# m_new = max(m_i, rowmax(S_ij))", "every thread has read red[tx, 0]")],
    2: [("the tiles (K rows padded by one word)", "Qi = cuda.shared.array", "Vj = cuda.shared.array"),
        ("the score, one chunk of the head dim at a time", "for d0 in range(0, d, Bc):",
         "the chunk is fully read")],
    3: [("the score: TM FMAs per K word, unsigned indices, unrolled in groups", "for cb in range(0, DK, UNROLL):",
         "# broadcast"),
        ("the online softmax: warp butterflies instead of trees", "# Online softmax.",
         "smem[P_OFF + (w * TM + i) * Bc + lane] = p")],
    4: [("the shared-memory layout: all of Q_i, one K chunk", "def layout(d):", "return DQ, K_OFF"),
        ("Q_i is copied once, before the key loop", "copy_tile(smem, 0, DQ, q", "copy_tile(smem, 0, DQ, q")],
    5: [("copies: 16 bytes per load and per store", "C4 = ncols >> 2", "ops.st_shared_x4(smem"),
        ("the score: 128-bit shared loads (K rows DK words apart: 32-way conflict)",
         "for c in range(0, DK, 4):", "s[i] += q0 * k0")],
    6: [("the whole change", "KS = DK + 4", "KS = DK + 4")],
    7: [("copies: cp.async, 16 bytes, no registers", "C4 = ncols >> 2", "16 if ok else 0)"),
        ("the pipeline over head-dim chunks", "for d0 in range(0, d, DK):", "slot = 1 - slot")],
    8: [("3×TF32: three tensor-core products per fp32 product", "def split(x):", "return big, x - big"),
        ("", "def mma3(", "return c0 + t0, c1 + t1"),
        ("the fragment layout, from ops.mma_tf32_m16n8k8's docstring", "A (16×8, row-major)",
         "c0 = C[g, 2t]", "numba_flash/ops.py"),
        ("S = Q_i K_jᵀ: this warp's half of the keys, one m16n8k8 per 8 keys and 8 head-dim columns",
         "qa = slot * SLOT", "s[n, 0], s[n, 1], s[n, 2], s[n, 3]"),
        ("the pair's row max, through shared memory", "mx = max(mx, warp.shfl_xor_sync(FULL, mx, 1))",
         "m_new = max(m[h], max(smem[row2], smem[row2 + 1]))"),
        ("O += P V: P from shared memory, this warp's half of the columns",
         "pa = P_OFF", "o[nn, 0], o[nn, 1], o[nn, 2], o[nn, 3] = mma3")],
}


# Per rung from 2: (what its docstring predicted, the verdict against the measurement[, other
# rungs to compare with]). The measured column comes from the rungs' Measured paragraphs:
# figures of that run are never typed here (those of other runs are, and say so).
PREDICTIONS = {
    2: ("~10× over rung 1", "as predicted"),
    3: ("6–8× over rung 2",
        "as predicted, after two fixes. Written as the C++ twin is (a 2 × 4 register tile per thread), it "
        "first ran at 13.0 ms: an `ncu` profile and the PTX showed three costs the C++ twin does not pay "
        "(rung 3's docstring, \"Numba's own costs\": a compare-and-add per shared access for Numba's "
        "negative indices, the range iterator's bookkeeping left in partly unrolled loops, copies whose "
        "every load waited for the previous store); fixing them gave 6.7 ms. Then a tile sweep on the H200 "
        "(the docstring's \"Tiles\") found the register tile to be the lever: 4 × 8 outputs per thread in "
        "8 warps, 64-column head-dim chunks: 1.83–1.97 ms in four runs"),
    4: ("≈ 1.3–1.5×", "just below the predicted range (1.42–1.56 ms in four runs)"),
    5: ("slower than rung 4",
        "as predicted (at rung 3's old 2 × 8 tiles it was 1.06× *faster*: the halved load-instruction "
        "count won there). At DK = 32 it was 2% over its C++ twin (2.15–2.26 ms); rung 4's 64-column "
        "chunks took it to 1.85–1.94"),
    6: ("beats rungs 4 and 5",
        "as predicted, once it took 64-column chunks too (at DK = 32: 1.44–1.56 ms, 0.95× rung 4)", (4,)),
    7: ("1.1–1.3×",
        "just under the prediction, because rung 6 gained more from DK = 64 than rung 7 can: at DK = 64 "
        "two rung 7 blocks (two K slots) no longer fit an SM, so it stays at DK = 32 (0.91–1.03 ms in four "
        "runs)"),
    8: ("0.3–0.5 ms, 2–3× rung 7 (issue slots, from the SASS)",
        "faster than rung 7 and accurate, unlike the seed's FP16 WMMA kernel (it fails 1e-4). Short of the "
        "prediction: 128 blocks of 4 warps is one warp per scheduler, so latencies the issue count "
        "ignores are exposed (docstring, \"Tiles\"; the kernel alone took 0.53 ms in its tile sweep). The "
        "first design (one warp per 16 rows, Bd = 128, `cvt.rna` splits, signed indices) took 1.11 ms, "
        "0.84× rung 7; warp pairs, the 2-instruction split, unsigned indices and Bc = 128 made this one"),
}


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def docstring_lines(src):
    """The (0-based) numbers of the lines of Python source ``src`` that lie in a docstring
    (or any other string standing alone as a statement)."""
    inside = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            inside.update(range(node.lineno - 1, node.end_lineno))
    return inside


def fragment(path, start, end, code=True):
    """The lines of ``path`` from the first containing ``start`` to the next containing ``end``,
    dedented. ``code``: ``path`` is Python and the anchors match outside its docstrings only
    (a docstring may quote the very line an excerpt starts at)."""
    text = Path(path).read_text()
    lines = text.splitlines()
    prose = docstring_lines(text) if code else set()
    try:
        i = next(n for n, line in enumerate(lines) if start in line and n not in prose)
        j = next(n for n in range(i, len(lines)) if end in lines[n] and n not in prose)
    except StopIteration:
        raise SystemExit(f"gen_ladder: anchor {start!r} .. {end!r} not found in {path}: update FRAGMENTS") from None
    while j + 1 < len(lines) and sum(x.count("(") - x.count(")") for x in lines[i:j + 1]) > 0:
        j += 1                   # a statement continued on the next lines is kept whole
    return textwrap.dedent("\n".join(lines[i:j + 1]))


def docstring_markdown(rung):
    """The rung's docstring as Markdown, without its title line."""
    doc = rung.module.__doc__.strip()
    body = doc.split("\n", 1)[1].strip()
    body = re.sub(r"::\n", ":\n", body)
    return re.sub(r"\n{3,}", "\n\n", body)


def overview():
    from numba_flash.ladder import RUNGS
    lines = ["| rung | file | change | PTX shows | seed's C++ on an H200 |",
             "|---:|---|---|---|---:|"]
    for r in RUNGS:
        claims = ", ".join(f"`{c}`" for c in r.ptx_claims) or "—"
        lines.append(f"| {r.number} | [`{r.name}.py`](../numba_flash/ladder/{r.name}.py) | **{r.title}**: "
                     f"{r.change} | {claims} | {r.seed_h200_ms:g} ms |")
    return "\n".join(lines)


def rungs():
    from numba_flash.ladder import RUNGS
    out = []
    for r in RUNGS:
        path = ROOT / "numba_flash" / "ladder" / f"{r.name}.py"
        out.append(f"### Rung {r.number} — {r.title}\n")
        out.append(f"[`numba_flash/ladder/{r.name}.py`](../numba_flash/ladder/{r.name}.py)"
                   + (f" · `diff numba_flash/ladder/{RUNGS[r.number - 2].name}.py "
                      f"numba_flash/ladder/{r.name}.py`" if r.number > 1 else "") + "\n")
        out.append(docstring_markdown(r) + "\n")
        for caption, start, end, *other in FRAGMENTS[r.number]:
            head = f"*Key code — {caption}:*\n\n" if caption else ""
            src, lang = (ROOT / other[0], "text") if other else (path, "python")
            out.append(f"{head}```{lang}\n{fragment(src, start, end, code=lang == 'python')}\n```\n")
    return "\n".join(out).rstrip()


MEASURED = re.compile(
    r"\*\*Measured\*\* \((?P<gpu>[^,]+), (?P<date>[0-9-]+), commit (?P<commit>[^;]+);.*?\): "
    r"(?P<ms>[0-9.]+) ms, (?P<tflops>[0-9.]+) TFLOP/s, max error (?P<err>\S+) against .*?\)\."
    r"(?: (?P<faster>[0-9.]+)× faster than rung \d+\.| Slower than rung \d+ \((?P<slower>[0-9.]+)×\)[^.]*\.)?"
    r" The seed's C\+\+ twin on an H200: (?P<twin>[0-9.]+) ms, so this rung is (?P<twin_x>[0-9.]+)× "
    r"(?P<twin_dir>faster|slower)")


def measured(doc):
    """The figures of a rung docstring's "Measured" paragraph (as :func:`measured_paragraph`
    writes it): gpu, date, commit (str), ms, tflops, err, twin, twin_x (float), vs_previous
    (float, None for rung 1), twin_dir ("faster" or "slower")."""
    m = MEASURED.search(" ".join(doc.split()))
    if m is None:
        raise SystemExit("gen_ladder: a rung's Measured paragraph is not in the form measured_paragraph writes")
    got = m.groupdict()
    for key in ("ms", "tflops", "err", "twin", "twin_x"):
        got[key] = float(got[key])
    x = got.pop("faster"), got.pop("slower")
    got["vs_previous"] = None if x == (None, None) else float(x[0] or x[1])
    return got


def predictions():
    """The predictions table: PREDICTIONS, with the measured column from the rung docstrings."""
    from numba_flash.ladder import RUNGS
    figures = {r.number: measured(r.module.__doc__) for r in RUNGS}
    runs = {(f["gpu"], f["date"], f["commit"]) for f in figures.values()}
    when = "; ".join(f"{g}, {d}, commit {c}" for g, d, c in sorted(runs))
    lines = [f"Measured: {when} (the Results table above; each rung's Measured paragraph).", "",
             "| rung | predicted | measured | |", "|---:|---|---|---|"]
    for n, (predicted, verdict, *others) in PREDICTIONS.items():
        f = figures[n]
        over = [f"{f['vs_previous']:.2f}× over rung {n - 1}"]
        over += [f"{figures[o]['ms'] / f['ms']:.2f}× over rung {o}" for o in (others[0] if others else ())]
        lines.append(f"| {n} | {predicted} | {', '.join(over)} ({f['ms']:.3f} ms; {f['twin_x']:.2f}× "
                     f"{f['twin_dir']} than the C++ twin's {f['twin']:.2f} ms) | {verdict} |")
    return "\n".join(lines)


def results(json_path):
    import json
    bench = _load_bench()
    doc = json.loads(Path(json_path).read_text())
    md = bench.render_markdown(doc, bench.LADDER_COLUMNS, bench.ladder_notes(doc)).rstrip()
    png = Path(json_path).with_suffix(".png")
    if png.exists():
        shutil.copyfile(png, CHART)
        md += f"\n\n![ladder timings]({CHART.name})"
    return md


def measured_paragraph(row, previous, doc, commit):
    """A rung's "Measured" docstring paragraph, from its row of a ``bench.py ladder`` JSON."""
    ours, val = row["ours"], row["validation"]
    ms, twin = ours["ms_median"], row["seed_h200_ms"]
    when = f"{doc['gpu']['name']}, {doc['date'][:10]}, commit {commit}"
    text = (f"**Measured** ({when}; N = d = 1024, ``python bench.py ladder``; written by "
            f"docs/gen_ladder.py): {ms:.3f} ms, {ours['tflops']:.2f} TFLOP/s, max error "
            f"{val['max_abs_err']:.1e} against the float64 oracle "
            f"({'passes' if val['valid'] else 'FAILS'} the seed's {val['tolerance']:.0e}).")
    if previous is not None:
        x = row["vs_previous"]
        text += (f" {x:.2f}× faster than rung {previous}." if x >= 1 else
                 f" Slower than rung {previous} ({x:.2f}×): a regression (see above).")
    text += f" The seed's C++ twin on an H200: {twin:.2f} ms, " + (
        f"so this rung is {twin / ms:.2f}× faster." if ms <= twin else f"so this rung is {ms / twin:.2f}× slower: "
                                                                       "its target is missed.")
    return textwrap.fill(text, width=90, break_long_words=False, break_on_hyphens=False)


def write_measured(json_path, commit=None):
    """Rewrite the "Measured" paragraph of each rung's docstring from a bench JSON."""
    import json
    from numba_flash.ladder import RUNGS
    doc = json.loads(Path(json_path).read_text())
    if commit is None:
        commit = doc["git_sha"][:7] + (" (dirty)" if doc.get("git_dirty") else "")
    rows = {row["rung"]: row for row in doc["rows"]}
    for r in RUNGS:
        if r.number not in rows:
            continue
        path = ROOT / "numba_flash" / "ladder" / f"{r.name}.py"
        src = path.read_text()
        para = measured_paragraph(rows[r.number], r.number - 1 if r.number > 1 else None, doc, commit)
        new, n = re.subn(r"\*\*Measured[^\n]*(?:\n(?!\n|\"\"\")[^\n]*)*", lambda m: para, src, count=1)
        if n != 1:
            raise SystemExit(f"gen_ladder: no **Measured** paragraph in {path}'s docstring")
        path.write_text(new)
        r.module.__doc__ = re.sub(r"\*\*Measured[^\n]*(?:\n(?!\n)[^\n]*)*", lambda m: para,
                                  r.module.__doc__, count=1)


def replace_block(text, name, body):
    pat = re.compile(rf"(<!-- BEGIN generated: {name} [^>]*-->\n)(.*?)(<!-- END generated: {name} -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"gen_ladder: no generated block {name!r} in {DOC}")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def render(text, results_json=None):
    text = replace_block(text, "overview", overview())
    text = replace_block(text, "rungs", rungs())
    text = replace_block(text, "predictions", predictions())
    if results_json:
        text = replace_block(text, "results", results(results_json))
    return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=None, help="JSON written by python bench.py ladder")
    p.add_argument("--commit", default=None,
                   help="the commit the measured tree is, where the JSON's git_sha is not it")
    p.add_argument("--check", action="store_true", help="only check that docs/ladder.md is up to date")
    a = p.parse_args(argv)
    if a.results and not a.check:
        write_measured(a.results, a.commit)
    text = DOC.read_text()
    return write_or_check(DOC, text, render(text, a.results), a.check, "python docs/gen_ladder.py")


def write_or_check(path, text, new, check, command):
    """Write ``new`` over ``path`` (now ``text``), or with ``check`` only say whether it would
    change it (exit status 1: stale). docs/gen_performance.py does the same."""
    name = path.relative_to(ROOT).as_posix()
    if check:
        if new != text:
            print(f"{name} is stale: run {command}")
            return 1
        print(f"{name} is up to date")
        return 0
    path.write_text(new)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
