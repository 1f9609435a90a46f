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
