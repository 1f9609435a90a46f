"""Benchmark numba_flash against PyTorch SDPA, after checking it against the float64 oracle.

    python bench.py                        # = python bench.py forward: anchors + seed, float32
    python bench.py --quick                # (4, 16, 4096, 128) and the seed shape only
    python bench.py forward --shapes anchors --dtype float32,float64 --repeats 50
    python bench.py --tiny --json /tmp/b.json    # simulator-sized smoke run (tests/test_bench.py)
    python bench.py backward               # attention_bwd vs SDPA backward, same shapes and options
    python bench.py ladder                 # the kernel ladder (numba_flash.ladder) on the seed problem
    python bench.py ladder --tiny          # ... in the simulator, as a smoke test
    python bench.py variants               # GQA, windows, softcap, ALiBi vs the plain call, SDPA, FlexAttention
    python bench.py variants --variant-rows "8 documents"   # one row (and the row it is compared with)
    python bench.py serving                # KV-cache decoding, packed varlen prefill vs SDPA
    python bench.py ring                   # ring attention on every GPU vs one GPU (--tiny: 2 CPU processes)
    python bench.py --dtype bfloat16 --csv /tmp/b.csv --plot /tmp/b.png   # also a CSV and a TFLOP/s plot

Every mode validates each configuration against the oracle, then times it (CUDA events, L2
flushed, median of many repeats), then writes JSON (``--json``), optionally Markdown, CSV
and a plot, and prints its table last. Stopped by Ctrl-C or SIGTERM (``timeout``) while
timing, the forward, backward, ladder, variants and serving modes write the rows they
finished, the JSON marked ``"interrupted": true``. The machinery lives in the package ``benchmarks/``
(its docstring says how it measures, and how to add a mode); this file is the command.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))   # benchmarks/ beside this file, wherever it is run from

from benchmarks import cli  # noqa: E402
from benchmarks.cli import MODES  # noqa: E402
from benchmarks.harness import (CAUSAL, QUICK_SHAPES, SHAPE_SETS, TOLERANCE, VALIDATE_ROWS, Shape,  # noqa: E402
                                forward_flops, max_abs_err, oracle_rows, select_shapes, validation_blocks)
from benchmarks.modes.backward import (BWD_FULL_N, BWD_TOLERANCE, BWD_VALIDATE_N, backward_flops,  # noqa: E402
                                       backward_oracle, backward_validation_shape, compare_grads, grads_mib)
from benchmarks.modes.forward import FORWARD_COLUMNS, forward_configs, forward_notes  # noqa: E402
from benchmarks.modes.ladder import LADDER_COLUMNS, ladder_notes  # noqa: E402
from benchmarks.modes.serving import SERVING_ROWS, SERVING_TOLERANCE, TINY_SERVING_ROWS, serving_flops  # noqa: E402
from benchmarks.modes.variants import TINY_VARIANT_ROWS, VARIANT_ROWS, variant_flops  # noqa: E402
from benchmarks.options import _common_options  # noqa: E402
from benchmarks.peers import PEERS  # noqa: E402
from benchmarks.report import render_markdown  # noqa: E402
from benchmarks.runner import mode_configs  # noqa: E402

# What tests/test_bench*.py and docs/gen_*.py read through this module.
__all__ = ["MODES", "CAUSAL", "QUICK_SHAPES", "SHAPE_SETS", "TOLERANCE", "VALIDATE_ROWS", "Shape", "forward_flops",
           "max_abs_err", "oracle_rows", "select_shapes", "validation_blocks", "BWD_FULL_N", "BWD_TOLERANCE",
           "BWD_VALIDATE_N", "backward_flops", "backward_oracle", "backward_validation_shape", "compare_grads",
           "grads_mib", "FORWARD_COLUMNS", "forward_configs", "forward_notes", "LADDER_COLUMNS", "ladder_notes",
           "SERVING_ROWS", "SERVING_TOLERANCE", "TINY_SERVING_ROWS", "serving_flops", "TINY_VARIANT_ROWS",
           "VARIANT_ROWS", "variant_flops", "_common_options", "PEERS", "render_markdown", "mode_configs",
           "parse_args", "main"]


def parse_args(argv=None):
    return cli.parse_args(argv, __doc__)


def main(argv=None):
    return cli.main(argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
