"""The developer tools' host-side parts (their measurements need a GPU)."""
import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_parses_shapes_and_rejects_bad_ones():
    ab = _load("ab")
    assert ab.parse_shapes("4,16,4096,128,1; 16,16,1024,128,0;") == [(4, 16, 4096, 128, 1, None, None, False),
                                                                     (16, 16, 1024, 128, 0, None, None, False)]
    assert ab.parse_shapes("1,16,16384,128,1,w=1024") == [(1, 16, 16384, 128, 1, 1024, None, False)]
    assert ab.parse_shapes("4,16,4096,128,0,c=30, w=0") == [(4, 16, 4096, 128, 0, 0, 30.0, False)]
    assert ab.parse_shapes("16,16,4096,128,1,t; 1,2,3,4,0,t,w=5") == [(16, 16, 4096, 128, 1, None, None, True),
                                                                     (1, 2, 3, 4, 0, 5, None, True)]
    for bad in ("4,16,4096,128", "4,16,4096,128,2", "0,16,4096,128,1", "1,16,64,64,1,w=-1", "1,2,3,4,1,5",
                "1,2,3,4,1,c=0", "1,2,3,4,1,x=3", "1,2,3,4,1,w=1,w=2", "1,2,3,4,1,c=a", "1,2,3,4,1,t,t",
                "1,2,3,t,1"):
        with pytest.raises(ValueError, match="B,H,N,d,causal"):
            ab.parse_shapes(bad)


def test_ab_parses_varlen_lengths():
    ab = _load("ab")
    assert ab.parse_lens("384*3, 100,0") == (384, 384, 384, 100, 0)
    assert ab.parse_lens("") == ab.VARLEN_LENS and len(ab.VARLEN_LENS) == 16
    for bad in ("384*0", "-1", "x*2"):
        with pytest.raises(ValueError, match="lengths"):
            ab.parse_lens(bad)
    # --lens repeats (a varlen batch each), every one checked before any tree runs
    with pytest.raises(ValueError, match="'x\\*2'"):
        ab.main(["--tree", ".", "--varlen", "--lens", "384*2", "--lens", "", "--lens", "x*2"])


def test_ab_summary_compares_each_tree_with_the_first():
    ab = _load("ab")
    records = [dict(call="fwd", tree=t, ms=ms) for t, ms in (("a", 1.0), ("b", 0.9), ("a", 1.0), ("b", 0.95))]
    lines = ab.summarise(records, ["a", "b"])
    assert len(lines) == 2 and "1.0000/1.0000" in lines[1] and "0.9000/0.9500 (-7.5%)" in lines[1]
    assert lines[1].endswith("n/a")                      # no hashes recorded


def test_ab_summary_tells_which_trees_changed_the_bits():
    ab = _load("ab")
    records = [dict(call="fwd", tree=t, ms=1.0, bits=h) for t, h in
               (("a", "x"), ("b", "x"), ("c", "y"), ("a", "x"), ("b", "x"), ("c", "x"))]
    assert ab.summarise(records, ["a", "b", "c"])[1].endswith("differ: 2; NOT REPEATABLE in 2")  # c's rounds disagree
    assert ab.summarise(records[:2] + records[3:5], ["a", "b"])[1].endswith("same")
    # a call whose results changed within one process (hashed before and after its timing)
    again = [dict(call="fwd", tree=t, ms=1.0, first=f, bits="x") for t, f in (("a", "x"), ("b", "z"))]
    assert ab.summarise(again, ["a", "b"])[1].endswith("same; NOT REPEATABLE in 1")


def test_ab_exports_a_revision(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ab = _load("ab")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        tree = ab.export_rev("HEAD", str(tmp_path / "rev"))
    finally:
        os.chdir(cwd)
    assert (Path(tree) / "numba_flash" / "__init__.py").exists()


def test_ab_tree_sets_module_constants(tmp_path):
    """``--tree "PATH;MODULE.NAME=VALUE"``: a copy of PATH's numba_flash with that line
    replaced, the original untouched; a name that is not one top-level line is refused."""
    ab = _load("ab")
    src = tmp_path / "src" / "numba_flash" / "kernels"
    src.mkdir(parents=True)
    (src / "k.py").write_text("A = 1\nFLAG = False  # off\n    FLAG = 3\n")
    tree = ab.with_constants(f"{tmp_path / 'src'}; kernels.k.FLAG=True", str(tmp_path / "copy"))
    assert (Path(tree) / "numba_flash" / "kernels" / "k.py").read_text() == "A = 1\nFLAG = True\n    FLAG = 3\n"
    assert (src / "k.py").read_text().startswith("A = 1\nFLAG = False")
    assert ab.with_constants(str(tmp_path / "src"), "unused") == str(tmp_path / "src")
    for bad in ("kernels.k.B=2", "FLAG=True", "kernels.k.FLAG="):
        with pytest.raises(ValueError, match="tree"):
            ab.with_constants(f"{tmp_path / 'src'};{bad}", str(tmp_path / f"bad{len(bad)}"))


def test_ab_sets_constants_in_this_process(monkeypatch):
    """``set_constants`` (trace_items' and sanitize's ``--set``): the literal set on the
    numba_flash module; a name the module lacks, or no value, is refused."""
    ab = _load("ab")
    from numba_flash.kernels import forward_wgmma
    monkeypatch.setattr(forward_wgmma, "PUBLISH_HEAD_DIM", forward_wgmma.PUBLISH_HEAD_DIM)
    ab.set_constants(["kernels.forward_wgmma.PUBLISH_HEAD_DIM=128"])
    assert forward_wgmma.PUBLISH_HEAD_DIM == 128 and forward_wgmma.publishes(96) and not forward_wgmma.publishes(256)
    for bad in ("kernels.forward_wgmma.NO_SUCH=1", "kernels.forward_wgmma.PUBLISH_HEAD_DIM=", "X=1"):
        with pytest.raises(SystemExit, match="--set"):
            ab.set_constants([bad])


def test_same_code_compares_instructions_not_mangled_counters():
    same_code = _load("same_code")
    listing = ("        /*0010*/                   MOV R1, c[0x0][0x28] ;   /* 0x00000a0000017a02 */\n"
               "        /*0020*/                   CALL.REL `(_ZN5forwardB4v{n}B7cw51cXTE) ;\n")
    a = {"k.sass": listing.format(n=273), "only_a.sass": listing.format(n=1)}
    b = {"k.sass": listing.format(n=302)}
    assert same_code.instructions(a["k.sass"]) == ["MOV R1, c[0x0][0x28]", "CALL.REL `(_ZN5forwardBvB7cw51cXTE)"]
    assert dict(same_code.compare(a, b)) == {"k.sass": "same", "only_a.sass": "only in one tree"}
    c = {"k.sass": listing.format(n=1).replace("R1", "R2")}
    assert dict(same_code.compare(a, c))["k.sass"] == "differs from instruction 0 (2 and 2 instructions)"


def test_gpu_pace_queues_each_repeat_behind_a_long_enough_sleep():
    """``benchmarks.gpu_pace``: each repeat's calls queued behind a sleep of at least 1.5×
    the host's queueing time (converted to cycles by the rate its calibration measured),
    the same number of calls each repeat, the median of the repeats' per-call times.
    A stand-in for PyTorch's CUDA calls records what would be queued."""
    import time
    from benchmarks.gpu_pace import gpu_pace_ms

    queue, ms_between = [], iter([2.0] + [float(x) for x in (9, 3, 5, 7, 1, 4, 8)])   # calibration, then repeats

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            queue.append("event")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return next(ms_between)

    class Cuda:
        Event = FakeEvent

        @staticmethod
        def _sleep(cycles):
            queue.append(("sleep", cycles))

        @staticmethod
        def synchronize():
            pass

    class Torch:
        cuda = Cuda

    def call():
        time.sleep(0.001)              # 1 ms of host time a call
        queue.append("call")

    ms = gpu_pace_ms(call, Torch, reps=7, min_calls=3, min_s=0.0)
    assert queue[:3] == ["call"] * 3 and queue[3:6] == ["event", ("sleep", 10**7), "event"]
    rate = 10**7 / 2e-3                 # cycles a second: the calibration's sleep took 2 ms
    repeats = queue[6:]
    assert len(repeats) == 7 * (3 + 3)
    for r in range(7):
        sleep, start, *calls, end = repeats[6 * r:6 * r + 6]
        assert sleep[0] == "sleep" and start == end == "event" and calls == ["call"] * 3
        assert sleep[1] >= rate * 1.5 * 3e-3            # at least 1.5 × three calls' host time
    assert ms == 5.0 / 3                                # the median repeat, per call


def test_host_time_rows():
    """tools/host_time.py: its row names are its rows' (bench.py's calls), checked."""
    host_time = _load("host_time")
    assert set(host_time._rows(lambda *shape: None)) == set(host_time.ROWS)
    assert host_time.parse_rows(" varlen, decode_gqa,") == ["varlen", "decode_gqa"]
    assert host_time.parse_rows("") == list(host_time.ROWS)
    with pytest.raises(ValueError, match="unknown 'decoding'; the rows are forward"):
        host_time.parse_rows("varlen,decoding")


def test_mufu_rate_runs_its_chains():
    """tools/mufu_rate.py: the three kernels run (two steps of eight chains, one block:
    tanh, ex2, the two interleaved) and give one rate each (nan in the simulator, whose
    events time nothing); bad options exit."""
    mufu_rate = _load("mufu_rate")
    rates = mufu_rate.main(["--iters", "2", "--blocks", "1"])
    assert set(rates) == {"tanh", "ex2", "tanh+ex2"}
    for bad in (["--ops", "tanh,log"], ["--iters", "0"]):
        with pytest.raises(SystemExit):
            mufu_rate.main(bad)


def test_first_call_parses_calls_and_rejects_bad_ones():
    first_call = _load("first_call")
    assert first_call.parse_calls("bfloat16,4,16,4096,128,0; float16,1,8,512,128,1;") == [
        ("bfloat16", 4, 16, 4096, 128, 0), ("float16", 1, 8, 512, 128, 1)]
    assert len(first_call.parse_calls(first_call.DEFAULT_CALLS)) == 2
    for bad in ("bfloat16,4,16,4096,128", "int8,4,16,4096,128,0", "bfloat16,0,16,4096,128,1",
                "bfloat16,4,16,4096,128,2"):
        with pytest.raises(ValueError, match="dtype,B,H,N,d,causal"):
            first_call.parse_calls(bad)


def test_first_call_offline_times_a_kernels_compile(tmp_path):
    """``--offline``: a fresh process compiles the named kernel to sm_90 PTX and its time
    is recorded (a name that matches no kernel is an error)."""
    import json
    first_call = _load("first_call")
    out = tmp_path / "first.json"
    assert first_call.main(["--offline", "forward_simt/float32/d32/full/plain", "--rounds", "1",
                            "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["kernel"] == "forward_simt/float32/d32/full/plain" and rec["seconds"] > 0
    with pytest.raises(RuntimeError, match="matched no kernel"):
        first_call.offline(["no_such_kernel"], 1)


def test_trace_items_in_the_simulator(monkeypatch):
    """``tools/trace_items.py``: a call's Hopper forward traced (three persistent blocks,
    two heads of 130 x 130 causal rows at d = 128: four items of one or two key tiles), its
    summary's items and phases, and the same by key tiles (one group here)."""
    import ml_dtypes
    import numpy as np
    from numba_flash import api, registry
    from conftest import ON_GPU
    trace_items = _load("trace_items")
    if ON_GPU:
        pytest.skip("the simulator's multiprocessor count is set here")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    monkeypatch.setenv("NUMBA_FLASH_CACHE", "0")
    monkeypatch.setattr(api, "_device_facts", lambda: (3, None, None))
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 130, 128)).astype(ml_dtypes.bfloat16) for _ in range(3))
    result, launches = api.plan_forward(q, k, v, causal=True)
    stamps, nwg, plain_ms, traced_ms = trace_items.trace_call(launches, [130], 2, repeats=1)
    assert nwg == 2 and stamps.shape[:2] == (3, 2)
    s = trace_items.summarise(stamps, nwg)
    assert s["items"] == 2 * 4 and s["first"] > 0 and s["tile"] > 0 and s["busy_max"] >= s["busy_mean"] > 0, s
    assert s["wait_k0"] >= 0, s             # (K_0 landed between Q landed and the first softmax)
    assert {g: s["by_tiles"][g]["items"] for g in s["by_tiles"]} == {"1-2": 2 * 4}, s["by_tiles"]
    assert s["by_tiles"]["1-2"]["first"] > 0 and s["by_tiles"]["1-2"]["store"] > 0, s["by_tiles"]
    table = trace_items.by_tiles_lines(s)
    assert len(table) == 2 and table[1].split()[:2] == ["1-2", "8"], table
    assert [trace_items.tile_group(t) for t in (1, 2, 3, 8, 9, 32, 33, 200)] == [
        "1-2", "1-2", "3-4", "5-8", "9-16", "17-32", "33+", "33+"]


def test_mbarrier_probe_passes_items_through_two_slots():
    """``tools/mbarrier_probe.py`` (racecheck's view of the published items' protocol):
    sixteen items through two slots reach every consumer thread whole and in order, here
    in the simulator's twins of the intrinsics."""
    probe = _load("mbarrier_probe")
    got, want = probe.run()
    assert want == 8 * sum(range(probe.ITEMS)) + 28 * probe.ITEMS
    assert (got == want).all(), got
