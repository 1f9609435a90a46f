"""bench.py's command line: the options every mode takes, the modes, ``parse_args`` and ``main``."""
import argparse
import dataclasses
import importlib.util
import sys

from numba_flash import SIMULATOR

from .environment import ROOT
from .harness import DEFAULT_MIN_TIME_S, DEFAULT_REPEATS, DEFAULT_WARMUP, TINY_REPEATS
from .modes.backward import BACKWARD_COLUMNS, backward_notes, run_backward
from .modes.forward import FORWARD_COLUMNS, forward_notes, run_forward
from .modes.ladder import LADDER_COLUMNS, ladder_notes, ladder_options, run_ladder
from .modes.ring import render_ring_markdown, ring_options, run_ring
from .modes.serving import SERVING_COLUMNS, run_serving, serving_notes, serving_options
from .modes.variants import render_variants_markdown, run_variants, variants_options
from .options import _common_options
from .report import PLOT_NEEDS, render_markdown


# --------------------------------------------------------------------------- command line
@dataclasses.dataclass(frozen=True)
class Mode:
    help: str
    run: object   # args -> exit status
    markdown: object   # a JSON document of the mode -> its Markdown table (--markdown, docs/gen_performance.py)
    options: object = None   # parser -> None: adds the mode's own options


def _markdown(columns, notes):
    return lambda doc: render_markdown(doc, columns, notes(doc))


MODES = {
    "forward": Mode("fused forward vs PyTorch SDPA (default)", run_forward,
                    _markdown(FORWARD_COLUMNS, forward_notes)),
    "backward": Mode("attention_bwd (dq, dk, dv) vs PyTorch SDPA backward", run_backward,
                     _markdown(BACKWARD_COLUMNS, backward_notes)),
    "ladder": Mode("the kernel ladder (numba_flash.ladder): the seed's Results table, rung by rung",
                   run_ladder, _markdown(LADDER_COLUMNS, ladder_notes), ladder_options),
    "variants": Mode("GQA, sliding window, softcap, ALiBi: vs the plain call and PyTorch's SDPA / FlexAttention",
                     run_variants, render_variants_markdown, variants_options),
    "serving": Mode("decoding against KV caches, packed variable-length prefill: vs SDPA and the padded batch",
                    run_serving, _markdown(SERVING_COLUMNS, serving_notes), serving_options),
    "ring": Mode("ring attention over every GPU (one process each, NCCL) vs one GPU at a shard's length",
                 run_ring, render_ring_markdown, ring_options),
}
DEFAULT_MODE = "forward"
NO_GPU = ("bench.py times kernels with CUDA events, so it needs a CUDA GPU, and none was found "
          "(kernels would run in Numba's CUDA simulator, where the default shapes take hours and "
          "times mean nothing). Without a GPU, run the smoke test instead: tiny shapes in the "
          "simulator, validated against the oracle, then timed (meaningless times):\n    python bench.py --tiny\n"
          "    python bench.py backward --tiny\n    python bench.py ladder --tiny")


def _all_options_help():
    """Every mode's options, for the top-level ``--help`` (argparse lists a sub-command's
    options only under ``bench.py MODE --help``)."""
    shown = argparse.ArgumentParser(prog="bench.py", add_help=False, usage=argparse.SUPPRESS)
    _common_options(shown.add_argument_group(f"options of every mode ({', '.join(MODES)})"))
    for name, mode in MODES.items():
        if mode.options is not None:
            mode.options(shown.add_argument_group(f"{name} options"))
    return shown.format_help().strip()


def parse_args(argv=None, doc=""):
    """``doc``: the command's docstring (its first two paragraphs open ``--help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in MODES and argv[0] not in ("-h", "--help")):
        argv.insert(0, DEFAULT_MODE)
    usage = doc.split("\n\n")[1]
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0] + "\n\n" + usage
        + "\n\nWithout a GPU only --tiny runs (a smoke test in the simulator).",
        epilog=_all_options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", metavar="MODE", help=f"default: {DEFAULT_MODE}")
    common = _common_options()
    for name, mode in MODES.items():
        sp = sub.add_parser(name, parents=[common], help=mode.help)
        sp.set_defaults(run=mode.run)
        if mode.options is not None:
            mode.options(sp)
    args = parser.parse_args(argv)
    args.argv = argv
    tiny = args.tiny
    args.repeats = args.repeats if args.repeats is not None else (TINY_REPEATS if tiny else DEFAULT_REPEATS)
    args.min_time = args.min_time if args.min_time is not None else (0.0 if tiny else DEFAULT_MIN_TIME_S)
    # --tiny in the simulator: no warm-up (there is no JIT to keep out of the times, which mean nothing there)
    args.warmup = args.warmup if args.warmup is not None else (
        (0 if SIMULATOR else 1) if tiny else DEFAULT_WARMUP)
    args.json = args.json or str(ROOT / "results" / f"bench-{args.mode}.json")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(PLOT_NEEDS)    # before the run, not after it
    return args


def _interrupt_on_sigterm():
    """A ``timeout`` (SIGTERM) stops a run as Ctrl-C does: the modes that time row by row
    then write the rows they finished, marked ``"interrupted": true``."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, stop)


def main(argv=None, doc=""):
    args = parse_args(argv, doc)
    if SIMULATOR and not args.tiny:
        print(NO_GPU, file=sys.stderr)
        return 2
    _interrupt_on_sigterm()
    return args.run(args)

