"""bench.py's command line as a user meets it: one --help that shows every mode's options,
and, without a GPU, an immediate answer instead of hours in the simulator."""
import argparse
import importlib.util
from pathlib import Path

import pytest

import numba_flash  # noqa: F401  (before numba: decides the simulator)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_top_level_help_shows_every_mode_option(bench, capsys):
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for name, mode in bench.MODES.items():
        assert name in text
        sub = argparse.ArgumentParser(add_help=False)
        if mode.options is not None:
            mode.options(sub)
        for action in sub._actions + bench._common_options()._actions:
            for flag in action.option_strings:
                assert flag in text, f"{flag} ({name}) missing from bench.py --help"


@pytest.mark.skipif(not numba_flash.SIMULATOR, reason="a GPU is present: bench.py runs")
@pytest.mark.parametrize("argv", [[], ["backward"], ["ladder", "--rungs", "1"]])
def test_without_gpu_says_so_at_once(bench, capsys, argv):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "python bench.py --tiny" in err
