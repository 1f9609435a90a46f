"""The machinery behind ``bench.py`` (the command: ``python bench.py --help``).

Every mode does the same four things, in this order:

1. **Validate** every configuration it will time: run the public API on the full inputs
   and compare a sub-slice of the result (first and last leading index, at most
   ``VALIDATE_ROWS`` query rows each, against the full K/V) with the float64 oracle
   ``numba_flash.reference``. A failure is printed loudly, the row is marked invalid, it
   is not timed, and the run exits with status 1.
2. **Time** the public API call (``numba_flash.attention_fwd``), so Python dispatch
   (input checks, kernel lookup, output allocation, launch) is *included*: each repeat
   is synchronised, L2 is flushed, then CUDA events bracket one call. Warm-up calls keep
   the JIT compile out; the median of at least ``--repeats`` repeats and ``--min-time``
   seconds is reported. The kernels alone (the launches ``api.plan_forward`` /
   ``plan_backward`` prepare for the same call) are timed the same way, so the table shows
   how much of each call is host work. The peers (``torch.nn.functional.scaled_dot_product_attention``
   with the EFFICIENT_ATTENTION and MATH backends, same input tensors) are timed the
   same way with ``torch.cuda.Event``; a peer that is unsupported or runs out of memory
   is reported as "—".
3. **Measure** the peak extra device memory of one call (ours: drop of the driver's free
   memory inside ``numba.cuda.defer_cleanup()``; torch: ``max_memory_allocated`` growth).
4. **Report**: JSON (environment, versions, git SHA, one record per row), optionally a
   Markdown fragment for docs/performance.md (``--markdown``), the rows as CSV (``--csv``)
   and a plot of TFLOP/s against sequence length (``--plot``, matplotlib), and a
   fixed-width table printed last. While it runs, a progress line on stderr says which
   configuration is being validated or timed (once the run has taken a few seconds).

FLOPs follow the FlashAttention convention: forward = 4·B·H·Nq·Nk·d, halved when causal;
backward = 2.5 × forward.

The ``backward`` mode differs only where the backward must: it validates dq, dk, dv of
``numba_flash.attention_bwd`` for the first leading index against
``reference.attention_bwd`` on the timed inputs when N <= ``BWD_FULL_N``, and otherwise on a
separately generated problem of the same B, H, d, causality and dtype with N =
``BWD_VALIDATE_N`` (dK/dV depend on every query row, so it cannot be checked on a row
slice); it times ``attention_bwd`` alone (out and lse precomputed by ``attention_fwd``),
and the peers' ``torch.autograd.grad`` through an SDPA output (graph retained).

The ``ladder`` mode reproduces the seed article's Results table with the rungs of
``numba_flash.ladder.RUNGS``: one row per rung (not per shape), on N = d = 1024 (``--n``,
``--d``; ``--shapes``, ``--dtype`` and the peers do not apply) with the seed's input
distribution. Each rung is validated on the timed inputs
(every element, against ``reference.attention``; pass/fail at 1e-4, the seed's tolerance),
then ``rung(q, k, v)`` on device arrays is timed as above. It writes the JSON, a bar chart
next to it (when matplotlib is importable) and the table (rung, change, ms, × vs the
previous rung, TFLOP/s, max abs error, pass/fail, the seed's C++ time on an H200).
``python docs/gen_ladder.py --results <json>`` puts the table into docs/ladder.md.

Layout: ``harness`` (configurations, inputs, validation helpers, timers, memory probes),
``environment`` (the JSON's environment record), ``peers`` (the SDPA and FlexAttention
peers), ``runner`` (the validate-then-time loop and ``run_mode``), ``report`` (table, JSON,
Markdown, CSV, plot, progress line), ``options`` and ``cli`` (the command line), and one
module per mode under ``modes/``.

Adding a mode: a module ``modes/<mode>.py`` with a ``validate_one(cfg, bench)`` and a
``time_one(cfg, val, ctx, bench)`` (see ``validate_forward_config`` / ``time_forward_row`` in
``modes/forward.py``), a ``<MODE>_COLUMNS`` table and its notes, a ``run_<mode>(args)`` that
hands them to ``runner.run_mode`` (or, when its rows are not shapes, to ``validate_all`` /
``time_all`` as ``run_ladder`` does, then to ``report.write_outputs``), and one entry in
``cli.MODES`` (with ``options`` for its own command-line options). Options shared by all
modes live in ``options._common_options``; the environment record, input generation,
timers, memory probes, peer wrapper and JSON/Markdown/CSV/table writers are
mode-agnostic.

Caveats: in Numba's CUDA simulator (no GPU) only ``--tiny`` runs (any other run stops at
once and says so); there are no CUDA events there, so it times with
``time.perf_counter`` and the numbers mean nothing; inputs there are NumPy
arrays (host round trip included). Free-memory deltas have the driver's allocation
granularity (2 MiB).
"""
