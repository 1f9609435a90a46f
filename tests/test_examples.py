"""Every example runs, as a user would run it, and succeeds (the examples assert their own results).

Without a GPU the examples choose tiny sizes for the simulator themselves.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, process_failure, project_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))


def test_examples_exist():
    assert EXAMPLES, "no examples found"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=project_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc, path.name)
    assert proc.stdout.strip(), f"{path.name} printed nothing"
