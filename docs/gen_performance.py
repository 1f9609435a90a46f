"""Regenerate the generated section at the end of docs/performance.md from committed bench.py JSON.

    python docs/gen_performance.py            # the section, from the JSON files git tracks under results/
    python docs/gen_performance.py --check    # exit 1 if the section is stale (a test)

docs/performance.md is hand-written down to the marker ``<!-- generated: ...`` and generated
from there to ``<!-- end generated -->``: one table per JSON file, each rendered by its
mode's own Markdown writer (``bench.py --markdown`` writes the same), under a heading that
names the mode, the date, the GPU ("simulator" for a run in Numba's CUDA simulator) and the
commit the run measured. The first run appends the section at the end of the file; later
runs replace it and nothing else.

The files are the ``results/*.json`` that git tracks (``bench.py``'s default outputs,
``results/bench-*``, are ignored; commit a run under another name to have it here).
``results/tiny-forward.json`` is a simulator smoke run (``python bench.py --tiny --json
results/tiny-forward.json``): it keeps the generator and its test honest; its times mean
nothing.
"""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "results"
BEGIN = "<!-- generated: docs/gen_performance.py from results/*.json; edit those files, not this section -->"
END = "<!-- end generated -->"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))

from gen_ladder import write_or_check  # noqa: E402  (beside this file)


def result_files():
    """The JSON files under results/ that git tracks, by name; every one there outside a checkout."""
    try:
        r = subprocess.run(["git", "ls-files", "--", "results/*.json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        r = None
    if r is None or r.returncode != 0:
        return sorted(RESULTS.glob("*.json"))
    return sorted(ROOT / name for name in r.stdout.split())


def heading(doc, path):
    """``### forward · simulator · 2026-12-01 · commit abc1234`` and what the run was."""
    where = "simulator" if doc.get("simulator") else doc["gpu"]["name"]
    sha = (doc.get("git_sha") or "unknown")[:7] + (" (uncommitted changes)" if doc.get("git_dirty") else "")
    lines = [f"### {doc['mode']} · {where} · {doc['date'][:10]} · commit {sha}", "",
             f"From [`{path.relative_to(ROOT).as_posix()}`](../{path.relative_to(ROOT).as_posix()}), "
             f"`python bench.py {' '.join(doc['settings'].get('argv', []))}`."]
    if doc.get("simulator"):
        lines[-1] += (" A simulator smoke run: it shows what the table holds and checks that the "
                      "generator works; its times mean nothing.")
    return "\n".join(lines)


def table(path):
    from benchmarks.cli import MODES
    doc = json.loads(Path(path).read_text())
    return heading(doc, Path(path)) + "\n\n" + MODES[doc["mode"]].markdown(doc).rstrip()


def section(paths):
    intro = ("## Generated tables\n\n"
             "Rendered by `python docs/gen_performance.py` from the `bench.py` JSON committed under "
             "`results/`, one table per file (`--check` says whether this section matches them). "
             "Everything above this section is written by hand.")
    body = "\n\n".join(table(p) for p in paths) if paths else "No results committed yet."
    return f"{BEGIN}\n{intro}\n\n{body}\n{END}"


def render(text, paths):
    """``text`` with its generated section replaced, or appended at the end when there is none."""
    pat = re.compile(r"<!-- generated: docs/gen_performance\.py[^>]*-->\n.*?<!-- end generated -->", re.S)
    new = section(paths)
    if pat.search(text):
        return pat.sub(lambda m: new, text, count=1)
    return text.rstrip("\n") + "\n\n" + new + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check that docs/performance.md is up to date")
    a = p.parse_args(argv)
    text = DOC.read_text()
    return write_or_check(DOC, text, render(text, result_files()), a.check, "python docs/gen_performance.py")


if __name__ == "__main__":
    sys.exit(main())
