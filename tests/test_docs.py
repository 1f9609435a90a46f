"""Documentation that must match the code: public docstrings and the README snippet."""
import inspect

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
