"""bench.py: the --tiny smoke run (simulator or GPU), its JSON, and the sub-slice oracle it validates with."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numba_flash import reference
from conftest import HANG_GUARD_S, process_failure, run_compile_probe

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny forward run writing every output it can: JSON, Markdown, CSV (and the plot
    where matplotlib is installed)."""
    out = tmp_path_factory.mktemp("bench")
    js, md = out / "b.json", out / "b.md"
    plot = ["--plot", str(out / "b.png")] if HAVE_MATPLOTLIB else []
    proc = subprocess.run([sys.executable, str(BENCH), "--tiny", "--json", str(js), "--markdown", str(md),
                           "--csv", str(out / "b.csv")] + plot,
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    return proc, js, md


def test_tiny_run_succeeds(tiny_run):
    proc, js, md = tiny_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert js.exists() and md.exists()


def test_tiny_json_has_valid_rows(tiny_run):
    proc, js, _ = tiny_run
    doc = json.loads(js.read_text())
    assert doc["mode"] == "forward"
    for key in ("date", "gpu", "versions", "git_sha", "settings", "rows"):
        assert key in doc
    assert doc["versions"]["numba"] and doc["versions"]["numpy"]
    rows = doc["rows"]
    expected = {(str(s), c) for s in bench.SHAPE_SETS["tiny"] for c in bench.CAUSAL}
    assert {(str(bench.Shape(**r["shape"])), r["causal"]) for r in rows} == expected
    for r in rows:
        v = r["validation"]
        assert r["valid"] is True and v["error"] is None
        assert 0 <= v["max_abs_err"] <= v["tolerance"] == bench.TOLERANCE[r["dtype"]]
        ours = r["ours"]
        assert ours["ms_median"] > 0 and ours["tflops"] > 0 and ours["repeats"] >= 1
        assert ours["kernel_ms_median"] > 0 and ours["kernel_tflops"] > 0
        assert set(ours["tiling"]) == {"TM", "TN", "CG", "RG", "DK", "DO"}
        assert isinstance(ours["use_async"], bool)
        assert r["flops"] == bench.forward_flops(bench.Shape(**r["shape"]), r["causal"])
        assert set(r["peers"]) == set(bench.PEERS)


def test_tiny_table_printed_last(tiny_run):
    proc, js, md = tiny_run
    lines = proc.stdout.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("shape (B,H,N,d)"))
    assert len(lines) - header < 16                       # only the table and its notes follow
    rows = lines[header + 2: header + 2 + len(json.loads(js.read_text())["rows"])]
    assert all(row.rstrip().endswith("ok") for row in rows)
    assert "dispatch overhead is INCLUDED" in proc.stdout
    assert md.read_text().count("\n|") >= 2 + len(rows)


def test_tiny_csv_has_a_header_and_the_json_rows(tiny_run):
    """--csv: a header, then one line per JSON row with the same fields (nested ones dotted)."""
    import csv
    proc, js, _ = tiny_run
    rows = json.loads(js.read_text())["rows"]
    with (js.parent / "b.csv").open(newline="") as fh:
        lines = list(csv.DictReader(fh))
    assert len(lines) == len(rows)
    for line, r in zip(lines, rows):
        assert {"mode", "shape.Nq", "causal", "dtype", "valid", "ours.ms_median", "ours.tflops",
                "validation.max_abs_err", "peers.sdpa_flash.error"} <= set(line)
        assert line["dtype"] == r["dtype"] and int(line["shape.Nq"]) == r["shape"]["Nq"]
        assert float(line["ours.ms_median"]) == r["ours"]["ms_median"]
        assert json.loads(line["ours.grid"]) == r["ours"]["grid"]          # lists stay JSON
        assert line["causal"] == str(r["causal"])


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_tiny_plot_is_a_png(tiny_run):
    proc, js, _ = tiny_run
    png = js.parent / "b.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{png}" in proc.stdout


@pytest.mark.skipif(HAVE_MATPLOTLIB, reason="matplotlib is installed")
def test_plot_without_matplotlib_fails_at_once(capsys):
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--tiny", "--plot", "x.png"])
    assert done.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_progress_line():
    """Plain lines when stderr is not a terminal; on one, a line rewritten in place and taken away."""
    import io
    from benchmarks.report import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    plain, term = io.StringIO(), Terminal()
    for stream in (plain, term):
        p = Progress("forward", 2, stream=stream, delay_s=0)
        p.step("validate float32 (1,2,19,16) full")
        p.clear()
        p.step("time float32 (1,2,19,16) full")
        p.close()
    assert plain.getvalue() == ("[1/2] forward validate float32 (1,2,19,16) full\n"
                                "[2/2] forward time float32 (1,2,19,16) full\n")
    assert "\n" not in term.getvalue() and term.getvalue().endswith("\r\x1b[K")
    assert "\r\x1b[K[2/2] forward time" in term.getvalue()
    quiet = io.StringIO()
    p = Progress("forward", 1, stream=quiet, delay_s=60)       # a short run says nothing
    p.step("x")
    p.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("nq, nk", [(37, 37), (20, 45), (45, 20), (9, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_oracle_rows_match_full_reference(nq, nk, causal):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((nq, 8)), rng.standard_normal((nk, 8)), rng.standard_normal((nk, 8))
    out, lse = reference.attention_fwd(q, k, v, causal=causal)
    for r0, r1 in [(0, 5), (nq - 5, nq), (2, nq - 1)]:
        o, l = bench.oracle_rows(q, k, v, r0, r1, causal=causal)
        np.testing.assert_allclose(o, out[r0:r1], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(l), np.isinf(lse[r0:r1]))
        np.testing.assert_allclose(l[np.isfinite(l)], lse[r0:r1][np.isfinite(l)], rtol=0, atol=1e-12)


def test_validation_blocks_subslice_big_shapes():
    s = bench.Shape(16, 16, 1024, 1024, 128)
    blocks = bench.validation_blocks(s)
    assert {b[0] for b in blocks} == {(0, 0), (15, 15)}
    assert sum(b[2] - b[1] for b in blocks if b[0] == (0, 0)) <= bench.VALIDATE_ROWS
    half = bench.VALIDATE_ROWS // 2
    assert ((0, 0), 0, half) in blocks and ((15, 15), 1024 - half, 1024) in blocks


def test_l2_flush_reads_every_word():
    """The flush's kernel (simulator): with a zero buffer it stores nothing; a buffer whose
    words XOR to one, wherever the one sits, makes it store, so every word is read."""
    from numba import cuda
    from benchmarks import harness
    kernel = cuda.jit(harness.read_all)
    rng = np.random.default_rng()
    n = int(rng.integers(40, 90))
    for where in (None, 0, int(rng.integers(1, n - 1)), n - 1):
        buf = np.zeros(n, dtype=np.uint64)
        if where is not None:
            buf[where] = 1
        sink = np.full(1, 7, dtype=np.uint64)
        kernel[2, 8](buf, sink)
        assert sink[0] == (7 if where is None else 1), where


def test_l2_flush_compiles_to_loads():
    """The flush's kernel compiles (no GPU: NVVM) and keeps its loads and its store."""
    out = run_compile_probe(
        "from numba import cuda; from benchmarks import harness\n"
        "ptx, _ = cuda.compile_ptx(harness.read_all, harness.FLUSH_SIGNATURE, cc=(9, 0))\n"
        "print(ptx.count('ld.global'), ptx.count('st.global'))")
    loads, stores = map(int, out.split()[-2:])
    assert loads >= 1 and stores == 1, out


def test_max_abs_err_nan_and_inf():
    assert bench.max_abs_err(np.array([np.nan]), np.array([0.0])) == np.inf
    assert bench.max_abs_err(np.array([-np.inf, 1.0]), np.array([-np.inf, 1.5])) == 0.5


def test_cli_defaults_and_modes():
    args = bench.parse_args([])
    assert args.mode == "forward" and args.shapes == ["anchors", "seed"] and args.dtype == ["float32"]
    assert args.json.endswith("results/bench-forward.json")
    shapes = bench.select_shapes(bench.parse_args(["--quick"]))
    assert shapes == bench.QUICK_SHAPES
    args = bench.parse_args(["forward", "--shapes", "seed", "--dtype", "float32,float64", "--repeats", "5"])
    assert bench.select_shapes(args) == bench.SHAPE_SETS["seed"] and args.repeats == 5
    assert len(bench.forward_configs(args)) == 2 * len(bench.CAUSAL)
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "nope"])


def test_anchor_shapes():
    anchors = bench.SHAPE_SETS["anchors"]
    assert len(anchors) == 6
    for s in anchors:
        assert s.B * s.Nq == 16384 and s.H * s.d == 2048 and s.Nq == s.Nk
    assert {(s.d, s.H) for s in anchors} == {(64, 32), (128, 16)}


# --------------------------------------------------------------------------- backward mode
@pytest.fixture(scope="module")
def tiny_backward_run(tmp_path_factory):
    js = tmp_path_factory.mktemp("bench_bwd") / "bb.json"
    # --repeats 1: a backward call takes about a second in the simulator, and its time means nothing.
    proc = subprocess.run([sys.executable, str(BENCH), "backward", "--tiny", "--repeats", "1", "--json", str(js)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    return proc, js


def test_tiny_backward_run_has_valid_rows(tiny_backward_run):
    proc, js = tiny_backward_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(js.read_text())
    assert doc["mode"] == "backward"
    for key in ("date", "gpu", "versions", "git_sha", "settings", "rows"):
        assert key in doc
    assert doc["settings"]["tolerance"] == bench.BWD_TOLERANCE
    rows = doc["rows"]
    expected = {(str(s), c) for s in bench.SHAPE_SETS["tiny"] for c in bench.CAUSAL}
    assert {(str(bench.Shape(**r["shape"])), r["causal"]) for r in rows} == expected
    for r in rows:
        shape, v = bench.Shape(**r["shape"]), r["validation"]
        assert r["mode"] == "backward" and r["valid"] is True and v["error"] is None
        assert v["same_inputs"] is True and bench.Shape(**v["problem"]) == shape   # tiny: N <= BWD_FULL_N
        assert set(v["grads"]) == {"dq", "dk", "dv"}
        for g in v["grads"].values():
            assert 0 <= g["max_abs_err"] <= g["tolerance"]
            assert g["tolerance"] == pytest.approx(bench.BWD_TOLERANCE[r["dtype"]] * max(1.0, g["ref_max_abs"]))
        assert r["flops"] == pytest.approx(2.5 * bench.forward_flops(shape, r["causal"]))
        ours = r["ours"]
        assert ours["ms_median"] > 0 and ours["tflops"] > 0 and ours["repeats"] >= 1
        assert ours["kernel_ms_median"] > 0 and ours["kernel_tflops"] > 0
        assert set(ours["kernels"]) == {"backward_dkdv_simt", "backward_dq_simt"}
        for k in ours["kernels"].values():
            assert set(k["tiling"]) == {"TM", "TN", "CG", "RG", "DK", "DO"}
        assert ours["grads_mib"] == pytest.approx(bench.grads_mib({"shape": shape, "dtype": r["dtype"]}))
        assert set(r["peers"]) == set(bench.PEERS)
    lines = proc.stdout.rstrip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("shape (B,H,N,d)"))
    assert "grads MiB" in lines[header]
    assert len(lines) - header < 16                       # only the table and its notes follow
    assert all(row.rstrip().endswith("ok") for row in lines[header + 2: header + 2 + len(rows)])


def test_backward_validation_shape():
    small = bench.Shape(16, 32, 1024, 1024, 64)
    assert bench.backward_validation_shape(small) == small
    for s in bench.SHAPE_SETS["anchors"] + bench.SHAPE_SETS["seed"]:
        vs = bench.backward_validation_shape(s)
        assert (vs.B, vs.H, vs.d) == (s.B, s.H, s.d)
        assert vs == s if s.Nq <= bench.BWD_FULL_N else vs.Nq == vs.Nk == bench.BWD_VALIDATE_N


def test_compare_grads_relative_tolerance():
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 1, 12, 8)) for _ in range(4))
    refs = bench.backward_oracle(q, k, v, do, True)
    assert set(refs) == {"dq", "dk", "dv"}
    grads = [x[None, None] for x in (refs["dq"], refs["dk"], refs["dv"])]
    res = bench.compare_grads(grads, refs, 3e-4)
    assert all(g["max_abs_err"] == 0 for g in res.values())
    grads[1] = grads[1] + 1e-2                                     # a wrong dk
    assert bench.compare_grads(grads, refs, 3e-4)["dk"]["max_abs_err"] == pytest.approx(1e-2)


def test_cli_backward_defaults():
    args = bench.parse_args(["backward"])
    assert args.mode == "backward" and args.shapes == ["anchors", "seed"] and args.dtype == ["float32"]
    assert args.json.endswith("results/bench-backward.json")
    assert bench.select_shapes(bench.parse_args(["backward", "--quick"])) == bench.QUICK_SHAPES


def test_unsupported_dtype_head_dim_pairs_are_left_out():
    """16-bit dtypes stop at d = 256: the seed shape (d = 1024) is not run for them, not failed."""
    args = bench.parse_args(["forward", "--dtype", "bfloat16,float32", "--shapes", "anchors,seed"])
    configs = bench.mode_configs(args)
    seed = bench.SHAPE_SETS["seed"][0]
    assert [c["dtype"] for c in configs if c["shape"] == seed] == ["float32", "float32"]
    assert sum(c["dtype"] == "bfloat16" for c in configs) == 2 * len(bench.SHAPE_SETS["anchors"])


# --------------------------------------------------------------------------- variants mode
def test_tiny_variants_run(tmp_path):
    """``bench.py variants --tiny`` (the 16-bit rows, forward only: the simulator's budget):
    every row validated against the oracle, compared with its base row, FLOPs from the
    visible area."""
    js = tmp_path / "v.json"
    proc = subprocess.run([sys.executable, str(BENCH), "variants", "--tiny", "--variant-dtypes", "bfloat16",
                           "--no-backward", "--repeats", "1", "--json", str(js)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    rows = json.loads(js.read_text())["rows"]
    expected = [r for r in bench.TINY_VARIANT_ROWS if r.dtype == "bfloat16"]
    assert [r["row"]["label"] for r in rows] == [r.label for r in expected]
    for rec, r in zip(rows, expected):
        assert rec["valid"] and rec["validation"]["max_abs_err"] <= bench.TOLERANCE["bfloat16"], rec["validation"]
        assert rec["flops"] == bench.variant_flops(r) > 0
        assert rec["ours"]["ms_median"] > 0
        assert ("vs_base" in rec) == (r.base is not None)
    window = next(rec for rec in rows if rec["row"]["window"])
    causal = next(rec for rec in rows if rec["row"]["label"] == "causal")
    assert window["flops"] < causal["flops"], "a window's FLOPs count its visible area only"
    assert proc.stdout.rstrip().splitlines()[-1].startswith("TFLOP/s count"), "the table ends the log"


def test_sigterm_writes_the_rows_done(tmp_path):
    """A ``timeout`` (SIGTERM) during a run: the rows timed so far are written, the
    document marked interrupted, and the exit is orderly."""
    import signal
    js = tmp_path / "v.json"
    proc = subprocess.Popen([sys.executable, str(BENCH), "variants", "--tiny", "--variant-dtypes", "bfloat16",
                             "--no-backward", "--repeats", "1", "--json", str(js)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:            # the first row's line: "  <label> bfloat16 ..."
            if line.startswith("  ") and "bfloat16" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    doc = json.loads(js.read_text())
    assert doc["interrupted"] is True and 1 <= len(doc["rows"]) < len(bench.TINY_VARIANT_ROWS) // 2, err[-2000:]
    assert "Interrupted after" in err


def test_variant_rows_selects_rows_and_their_bases():
    """``--variant-rows``: the named rows with the rows they are compared with, in table
    order; an unknown label is an error that lists the labels."""
    from benchmarks.modes.variants import select_rows
    rows = [r for r in bench.TINY_VARIANT_ROWS if r.dtype == "bfloat16"]
    assert select_rows(rows, None) == rows
    assert [r.label for r in select_rows(rows, ["8 documents", "alibi"])] == ["plain", "alibi", "full", "8 documents"]
    with pytest.raises(ValueError, match="no row is labelled 'eight docs'.*8 documents"):
        select_rows(rows, ["eight docs"])


# --------------------------------------------------------------------------- serving mode
def test_tiny_serving_run(tmp_path):
    """``bench.py serving --tiny`` (bfloat16 rows): KV-cache (contiguous, paged) and 4-D decoding, a packed
    varlen prefill and its padded batch, each validated against the oracle; the varlen
    row compared with the padded one; FLOPs of the visible pairs."""
    js = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, str(BENCH), "serving", "--tiny", "--serving-dtypes", "bfloat16",
                           "--repeats", "1", "--json", str(js)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    rows = json.loads(js.read_text())["rows"]
    expected = [r for r in bench.TINY_SERVING_ROWS if r.dtype == "bfloat16"]
    assert [r["row"]["label"] for r in rows] == [r.label for r in expected]
    for rec, r in zip(rows, expected):
        assert rec["valid"] and rec["max_abs_err"] <= bench.SERVING_TOLERANCE["bfloat16"], rec
        assert rec["flops"] == bench.serving_flops(r) > 0 and rec["ours"]["ms_median"] > 0
    varlen, padded = (next(rec for rec in rows if rec["row"]["kind"] == k) for k in ("varlen", "padded"))
    assert varlen["flops"] < padded["flops"] and "vs_padded" in varlen
    paged = next(rec for rec in rows if rec["row"]["kind"] == "paged")
    assert "vs_contiguous" in paged
    for rec in rows:            # decoding rows: back to back over two copies of their inputs
        decoding = rec["row"]["kind"] in ("kvcache", "paged", "decode")
        assert (rec.get("layers"), rec["ours"].get("back_to_back_ms", 0) > 0) == ((2, True) if decoding else
                                                                                  (None, False)), rec


def test_serving_layers_hold_more_than_l2():
    """The decoding rows' back-to-back calls take turns over copies of their inputs that
    hold together at least LAYER_BYTES of K/V (or MAX_LAYERS copies), in order."""
    from benchmarks.modes import serving
    decoding = [r for r in bench.SERVING_ROWS if r.kind in ("kvcache", "paged", "decode")]
    assert decoding
    for r in decoding:
        n = serving.layer_count(r)
        assert 2 <= n <= serving.MAX_LAYERS
        assert n * serving.serving_bytes(r) >= serving.LAYER_BYTES or n == serving.MAX_LAYERS, (r, n)
        assert (n - 1) * serving.serving_bytes(r) < serving.LAYER_BYTES or n == 2, (r, n)
    seen = []
    call = serving.in_turn([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
