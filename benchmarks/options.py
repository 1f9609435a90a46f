"""Options every mode takes, and the comma-separated choice type the modes' own options use."""
import argparse

from numba_flash import registry

from .harness import DEFAULT_MIN_TIME_S, DEFAULT_REPEATS, DEFAULT_SHAPES, DEFAULT_WARMUP, QUICK_SHAPES, SHAPE_SETS, TINY_REPEATS


def _csv_choice(choices):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"got {text!r}; choose a comma-separated subset of {', '.join(choices)}")
        return items
    return parse


def _common_options(p=None):
    """Options every mode takes: added to ``p`` (a parser or an argument group), or to a new
    parent parser."""
    p = p if p is not None else argparse.ArgumentParser(add_help=False)
    p.add_argument("--shapes", type=_csv_choice([k for k in SHAPE_SETS if k != "tiny"]),
                   default=list(DEFAULT_SHAPES),
                   help=f"shape sets, comma-separated (default: {','.join(DEFAULT_SHAPES)})")
    dtypes = registry.dtypes("forward")
    p.add_argument("--dtype", type=_csv_choice(dtypes), default=["float32"],
                   help="dtypes, comma-separated, from " + ", ".join(dtypes) + " (default: float32)")
    p.add_argument("--quick", action="store_true", help="only " + ", ".join(map(str, QUICK_SHAPES)))
    p.add_argument("--tiny", action="store_true",
                   help="simulator-sized shapes, few repeats: a smoke test (works without a GPU)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"minimum timed repeats (default {DEFAULT_REPEATS}; {TINY_REPEATS} with --tiny)")
    p.add_argument("--min-time", type=float, default=None,
                   help=f"minimum total timed seconds per row (default {DEFAULT_MIN_TIME_S:g}; 0 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed calls first (default {DEFAULT_WARMUP}; with --tiny 1, or 0 in the simulator)")
    p.add_argument("--no-peers", action="store_true", help="skip the PyTorch SDPA peers")
    p.add_argument("--no-flush-l2", action="store_true", help="do not evict L2 between repeats")
    p.add_argument("--json", default=None, help="JSON output (default: results/bench-<mode>.json)")
    p.add_argument("--markdown", default=None, help="also write the table as a Markdown fragment here")
    p.add_argument("--csv", default=None, metavar="PATH",
                   help="also write the rows as CSV here: one line per measured configuration, the JSON rows' "
                        "fields (nested ones as ours.ms_median, peers.sdpa_flash.tflops, ...)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="also plot TFLOP/s against sequence length per (dtype, causal, head dim), numba_flash and "
                        "each peer a line (ladder: its bar chart); needs matplotlib")
    return p
