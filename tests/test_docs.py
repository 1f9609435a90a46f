"""Documentation that must match the code: public docstrings and the README snippet."""
import inspect
import math
from pathlib import Path

import numpy as np
import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)
from numba_flash import reference

PUBLIC = [getattr(numba_flash, n) for n in numba_flash.__all__ if inspect.isfunction(getattr(numba_flash, n))]
PUBLIC += [getattr(reference, n) for n in reference.__all__]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_public_docstring_opens_with_the_signature(fn):
    """``help(fn)`` shows the full call, arguments and result, then what it computes."""
    doc = inspect.getdoc(fn)
    first = doc.splitlines()[0]
    assert first.startswith(f"{fn.__name__}{inspect.signature(fn)} -> "), first
    assert len(doc.splitlines()) > 3, "more than a pointer elsewhere"


# --------------------------------------------------------------------------- examples in the text
ROOT = Path(__file__).resolve().parents[1]
SIM_BUDGET = 32 * 16 * 2     # elements of q per call: a few seconds per call in the simulator


def _readme_snippet():
    text = (ROOT / "README.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def _docstring_example():
    return "\n".join(line[4:] for line in numba_flash.__doc__.splitlines() if line.startswith(">>> "))


@pytest.mark.parametrize("source", [_readme_snippet, _docstring_example], ids=["README", "docstring"])
def test_text_examples_run_and_are_simulator_sized(source, monkeypatch):
    """The README's snippet and the package docstring's example run as written (the kernels
    replaced by the oracle, to stay cheap) and, without a GPU, call with tiny inputs: the
    simulator runs one Python thread per GPU thread, and a GPU-sized call looks hung."""
    shapes = []

    def fwd(q, k, v, *, causal=False, scale=None):
        shapes.append(q.shape)
        out, lse = reference.attention_fwd(q, k, v, causal=causal, scale=scale)
        return out.astype(q.dtype), lse.astype(np.float32)

    def bwd(dout, q, k, v, out, lse, *, causal=False, scale=None):
        shapes.append(q.shape)
        return tuple(g.astype(q.dtype) for g in reference.attention_bwd(dout, q, k, v, causal=causal, scale=scale))

    monkeypatch.setattr(numba_flash, "attention_fwd", fwd)
    monkeypatch.setattr(numba_flash, "attention", lambda *a, **kw: fwd(*a, **kw)[0])
    monkeypatch.setattr(numba_flash, "attention_bwd", bwd)
    exec(compile(source(), source.__name__, "exec"), {})
    assert shapes
    if numba_flash.SIMULATOR:
        assert max(math.prod(s) for s in shapes) <= SIM_BUDGET


# --------------------------------------------------------------------------- docs/ladder.md
def _docs_script(name):
    """docs/<name>.py, loaded as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


@pytest.fixture(scope="module")
def gen_ladder():
    return _docs_script("gen_ladder")


def _parses(excerpt):
    """An excerpt cut from inside a block may start deeper than it ends: give it the blocks."""
    import ast
    first = len(excerpt) - len(excerpt.lstrip(" "))
    ast.parse("".join(" " * i + "if True:\n" for i in range(0, first, 4)) + excerpt)


def test_ladder_excerpts_are_the_code_they_claim_to_be(gen_ladder):
    """Each Python excerpt of docs/ladder.md is rung code: it parses, its lines are the rung
    file's, and it starts and ends in code, not in a docstring (an anchor once matched
    docstring prose, and the excerpt began with prose and a stray triple quote)."""
    from numba_flash.ladder import RUNGS
    for r in RUNGS:
        path = Path(r.module.__file__)
        src = path.read_text().splitlines()
        prose = gen_ladder.docstring_lines(path.read_text())
        for caption, start, end, *other in gen_ladder.FRAGMENTS[r.number]:
            if other:            # quoted as text from another file, on purpose
                continue
            excerpt = gen_ladder.fragment(path, start, end)
            _parses(excerpt)
            lines = excerpt.splitlines()
            at = [i for i in range(len(src)) if src[i].strip() == lines[0].strip()
                  and all(a.strip() == b.strip() for a, b in zip(src[i:i + len(lines)], lines))]
            assert at and not prose & {at[0], at[0] + len(lines) - 1}, (r.name, caption)
            assert excerpt.count('"""') % 2 == 0, (r.name, caption)


def test_measured_paragraph_round_trip(gen_ladder):
    """The predictions table reads the figures back from the paragraph gen_ladder writes."""
    doc = {"gpu": {"name": "NVIDIA H200"}, "date": "2026-01-02T00:00:00"}
    for x, ms, twin in ((1.75, 0.588, 10.1), (0.83, 1.88, 1.2)):
        row = {"ours": {"ms_median": ms, "tflops": 7.31}, "seed_h200_ms": twin, "vs_previous": x,
               "validation": {"max_abs_err": 2.1e-5, "valid": True, "tolerance": 1e-4}}
        got = gen_ladder.measured(gen_ladder.measured_paragraph(row, 7, doc, "abc1234"))
        assert (got["gpu"], got["date"], got["commit"]) == ("NVIDIA H200", "2026-01-02", "abc1234")
        assert (got["ms"], got["vs_previous"], got["twin"], got["err"]) == (ms, x, twin, 2.1e-5)
        assert got["twin_dir"] == ("faster" if ms <= twin else "slower")


def test_ladder_figures_have_one_source(gen_ladder):
    """The Results table and the predictions table of docs/ladder.md show the same run's figures
    (rung 2 once read 11.50× in one and 11.7× in the other)."""
    from numba_flash.ladder import RUNGS
    text = (ROOT / "docs" / "ladder.md").read_text()
    results = text.split("<!-- BEGIN generated: results")[1].split("<!-- END generated: results")[0]
    rows = {int(c[0]): c for c in (line.strip("|").split("|") for line in results.splitlines()
                                   if line.startswith("| ") and line[2:3].isdigit())}
    predictions = text.split("<!-- BEGIN generated: predictions")[1].split("<!-- END generated: predictions")[0]
    predicted = {int(line.split("|")[1]): line for line in predictions.splitlines()
                 if line.startswith("| ") and line[2:3].isdigit()}
    for r in RUNGS:
        f = gen_ladder.measured(r.module.__doc__)
        cells = [c.strip() for c in rows[r.number]]
        assert float(cells[2]) == f["ms"], r.name
        if f["vs_previous"] is not None:
            assert float(cells[3]) == f["vs_previous"], r.name
            assert f"{f['vs_previous']:.2f}× over rung {r.number - 1}" in predicted[r.number], r.name
            assert f"({f['ms']:.3f} ms;" in predicted[r.number], r.name


# --------------------------------------------------------------------------- docs/performance.md
@pytest.fixture(scope="module")
def gen_performance():
    return _docs_script("gen_performance")


def test_performance_generated_section_matches_the_json(gen_performance):
    """The tables at the end of docs/performance.md are those docs/gen_performance.py renders from
    the committed results/*.json (as docs/ladder.md's are from its sources): run it after
    committing a result."""
    text = (ROOT / "docs" / "performance.md").read_text()
    files = gen_performance.result_files()
    assert files, "results/ holds at least the committed smoke run"
    assert gen_performance.render(text, files) == text, "stale: run python docs/gen_performance.py"
    assert text.rstrip().endswith(gen_performance.END) and text.count(gen_performance.BEGIN) == 1


def test_performance_generator_appends_once_and_names_each_run(gen_performance):
    """The section goes after the hand-written text, which it leaves as it is; a second run
    replaces it; each table says its mode, date, GPU or "simulator", and commit."""
    import json
    files = gen_performance.result_files()
    hand = "# Performance\n\nWritten by hand.\n"
    once = gen_performance.render(hand, files)
    assert once.startswith(hand) and once.endswith(gen_performance.END + "\n")
    assert gen_performance.render(once, files) == once
    for path in files:
        doc = json.loads(path.read_text())
        where = "simulator" if doc["simulator"] else doc["gpu"]["name"]
        assert f"### {doc['mode']} · {where} · {doc['date'][:10]} · commit {doc['git_sha'][:7]}" in once
        assert once.count("\n| ") >= len(doc["rows"])
    emptied = gen_performance.render(once, [])
    assert emptied.startswith(hand) and "No results committed yet." in emptied and "### " not in emptied


# --------------------------------------------------------------------------- docs/debugging.md
def test_debugging_tutorial_follows_rung_1(tmp_path, monkeypatch, capsys):
    """docs/debugging.md edits a copy of rung 1 at lines it quotes (they must still be in the
    rung), and its driver runs that copy as it is."""
    import importlib.util
    import sys
    from numba_flash import ladder
    text = (ROOT / "docs" / "debugging.md").read_text()
    rung = Path(ladder.rung(1).module.__file__).read_text()
    assert "SIM_TILES = dict(Br=4, Bc=4)" in rung and "4 × 4 tiles (`SIM_TILES`)" in text
    for line in ("m_new = max(m_i, red[tx, 0])",
                 "cuda.syncthreads()           # all of S_ij is written before the tree reads it",
                 "cuda.syncthreads()           # every thread has read red[tx, 0] before red is reused",
                 "if row < Nq:             # rows past the end score 0 (finite) and are never stored",
                 "acc += q[row, c] * k[key, c]"):
        assert line in text and line in rung, line
    (tmp_path / "my_rung.py").write_text(rung)
    spec = importlib.util.spec_from_file_location("my_rung", tmp_path / "my_rung.py")
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)
    monkeypatch.setitem(sys.modules, "my_rung", mine)
    driver = text.split("`drive.py`:\n\n```python\n", 1)[1].split("```", 1)[0]
    exec(compile(driver, "drive.py", "exec"), {})
    assert float(capsys.readouterr().out.split("=")[-1]) < 1e-6


# --------------------------------------------------------------------------- packaging
def test_changelog_and_license_match_the_package():
    import configparser
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {numba_flash.__version__} " in changelog, "a CHANGELOG.md entry for __version__"
    assert "`vX.Y.Z`" in changelog and "## Unreleased" in changelog
    meta = configparser.ConfigParser()
    meta.read(ROOT / "setup.cfg")
    assert meta["metadata"]["license"] == "MIT" and "MIT License" in (ROOT / "LICENSE").read_text()
    assert meta["metadata"]["author"] and meta["metadata"]["url"].startswith("https://")
