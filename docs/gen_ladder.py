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
  the code);
* ``results``: the table ``python bench.py ladder`` measured, rendered from its JSON,
  and its bar chart (copied next to this file). Left as it is without ``--results``.

With ``--results`` the "Measured" paragraph of each rung's docstring is rewritten too,
from the same JSON: the numbers in the rung files are never typed by hand.
"""
import argparse
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


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fragment(path, start, end):
    """The lines of ``path`` from the first containing ``start`` to the next containing ``end``,
    dedented."""
    lines = Path(path).read_text().splitlines()
    try:
        i = next(n for n, line in enumerate(lines) if start in line)
        j = next(n for n in range(i, len(lines)) if end in lines[n])
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
            out.append(f"{head}```{lang}\n{fragment(src, start, end)}\n```\n")
    return "\n".join(out).rstrip()


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
    new = render(text, a.results)
    if a.check:
        if new != text:
            print("docs/ladder.md is stale: run python docs/gen_ladder.py")
            return 1
        print("docs/ladder.md is up to date")
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
