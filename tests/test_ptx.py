"""Offline PTX checks of every registered kernel specialisation (no GPU needed).

``python -m numba_flash.ptx`` compiles each specialisation of ``registry.specialisations()``
with NVVM and prints one JSON line of instruction counts per kernel. The compiles are
slow (minutes per run), so the runs start together, in parallel subprocesses, as soon as
pytest has collected this module (see conftest.py), and one module-scoped fixture
collects their output.
"""
import json
import os
from pathlib import Path

import pytest

from numba_flash import ptx as ptx_tool
from numba_flash import registry
from numba_flash.kernels import forward_wgmma
from numba_flash.scores import PACKED_SPECS, PAGED_SPECS, RULE_SPECS, SCORE_SPECS, SOFTCAP_TANH
from conftest import HANG_GUARD_S, ON_GPU, collect_ptx_compile, project_env, start_ptx_compile

ROOT = Path(__file__).resolve().parents[1]
SPECS = {s.name: s for s in registry.specialisations()}
EXPECTED = set(SPECS)
HOPPER = {n for n in EXPECTED if registry.VARIANTS[n.split("/")[0]].arch == "sm_90a"}
FORWARD = "forward_simt"
MMA = "forward_mma"
MMA_BACKWARD = ("backward_dkdv_mma/", "backward_dq_mma/")
HOPPER_FEATURES = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier")
# kernels with a producer warpgroup that gives its registers to the consumers (the backward's
# blocks are two consumer warpgroups, one of whose threads issues the loads: no setmaxnreg)
WARP_SPECIALISED = ("forward_wgmma/",)


def _layout_a_filters():
    """``--only`` filters of the layout-A runs, one per dtype: the forward kernels of d = 64
    if the registry lists that head dim, else of its smallest head dim for that dtype."""
    filters = {}
    for s in registry.specialisations():
        if s.variant == FORWARD and (s.dtype not in filters or s.d == 64):
            filters[s.dtype] = f"{FORWARD}/{s.dtype}/d{s.d}/"
    return filters


ONLY_A = _layout_a_filters()
CCS = ("8.0", "9.0")
BUILT = CCS + ("9.0a",)     # the Hopper kernels are built for 9.0a when 9.0 is asked for
SHARDS = 2      # the registry's kernels, compiled in this many parallel processes
SASS = ["--sass"] if ptx_tool.find_tool("nvdisasm") else []
RUNS = {
    # (--sass where nvdisasm is found: the Hopper kernels' operand races counted too)
    **{f"shard{k}": ["--cc", ",".join(CCS), "--ptxas", *SASS, "--shard", f"{k}/{SHARDS}"] for k in range(SHARDS)},
    **{f"layoutA-{dt}": ["--cc", "9.0", "--layout", "A", "--only", f] for dt, f in ONLY_A.items()},
}


_PROCS = {}
_PROBES = {}        # compile probe -> its process (started with the runs) or, once collected, its stdout
OUT_DIR = None      # the layout-A runs also write their PTX files here (--out)


def start_runs():
    """Start every run in RUNS (once; later calls return the same processes).

    conftest.py calls this as soon as collection finishes, so the slow compiles use the
    CPU that the single-threaded simulator tests leave idle; they run at a lower
    priority so as not to slow those tests down. The layout-A runs leave
    ``NUMBA_ENABLE_CUDASIM`` unset, as a user would: the command must set what it needs.
    """
    global OUT_DIR
    if not _PROCS:
        import tempfile
        OUT_DIR = tempfile.mkdtemp(prefix="numba_flash_ptx_")
        for name, args in RUNS.items():
            layout_a = name.startswith("layoutA-")
            env = project_env(NUMBA_ENABLE_CUDASIM=None if layout_a else "0")
            extra = ["--out", os.path.join(OUT_DIR, name)] if layout_a else []
            _PROCS[name] = start_ptx_compile([*args, *extra], env)
        for name, code in _probe_scripts().items():
            _PROBES[name] = start_ptx_compile((), project_env(NUMBA_ENABLE_CUDASIM="0"), code=code)
    return _PROCS


def stop_runs(probes=True):
    """Kill the runs this module started that are still going (e.g. after ``pytest -x``),
    and with ``probes`` the compile probes too."""
    for p in list(_PROCS.values()) + (list(_PROBES.values()) if probes else []):
        if hasattr(p, "poll") and p.poll() is None:
            p.kill()
            p.wait()


def probe_output(name):
    """The stdout of the compile probe ``name`` (:func:`_probe_scripts`), started with the
    runs so that it compiles while the simulator tests run rather than after them; the
    test fails with the tail of its stderr if the probe failed."""
    start_runs()
    p = _PROBES[name]
    if not isinstance(p, str):
        out, err = collect_ptx_compile(p, timeout=HANG_GUARD_S)
        assert p.returncode == 0, f"compile probe {name} exited {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
        _PROBES[name] = p = out
    return p


@pytest.fixture(scope="module")
def ptx_runs():
    """{run: (returncode, [parsed JSON rows], stderr)} for every run in RUNS."""
    results = {}
    try:
        for name, p in start_runs().items():
            out, err = collect_ptx_compile(p, timeout=HANG_GUARD_S)
            rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
            results[name] = (p.returncode, rows, err)
    finally:
        stop_runs(probes=False)
    return results


def _rows(ptx_runs, run):
    rc, rows, err = ptx_runs[run]
    assert rc == 0, f"python -m numba_flash.ptx {' '.join(RUNS[run])} failed:\n{err[-4000:]}"
    assert rows, f"no specialisation compiled:\n{err[-4000:]}"
    return rows


def _cc_rows(ptx_runs, cc):
    """The rows of every shard for compute capability ``cc``."""
    return [r for k in range(SHARDS) for r in _rows(ptx_runs, f"shard{k}") if r["cc"] == cc]


def _check_row(r):
    """Everything one kernel's PTX must satisfy; returns a list of problems."""
    name, bad = r["name"], []
    if r["local"] != 0:
        bad.append(f"{r['local']} .local references (register spills or local arrays)")
    if r["dtype"] != "float64" and r["f64"] != 0:
        bad.append(f"{r['f64']} .f64 instructions in a {r['dtype']} kernel")
    if name in HOPPER:
        for feature in HOPPER_FEATURES:
            if r[feature] == 0:
                bad.append(f"no {feature} in a Hopper kernel")
        if name.startswith(WARP_SPECIALISED) and r["setmaxnreg"] == 0:
            bad.append("no setmaxnreg in a warp-specialised Hopper kernel")
        # 384 threads get 168 registers each at launch (65536 / 384, a multiple of 8): the
        # block's pool is 64512, and consumers that ask for more than the producer left
        # wait forever
        if name.startswith(WARP_SPECIALISED) and 128 * r["setmaxnreg.dec"] + 256 * r["setmaxnreg.inc"] > 168 * 384:
            bad.append(f"setmaxnreg {r['setmaxnreg.dec']} / {r['setmaxnreg.inc']}: more than the block's 64512 registers")
    elif name.endswith("/async") and r["cp.async"] == 0:
        bad.append("an /async kernel without cp.async")
    if name.endswith("/plain") and r["cp.async"] != 0:
        bad.append(f"a /plain kernel with {r['cp.async']} cp.async")
    if r["cp.async"] != r["cp.async.L2::128B"]:
        bad.append(f"{r['cp.async'] - r['cp.async.L2::128B']} cp.async without the .L2::128B fetch hint")
    if name.startswith(FORWARD + "/"):
        if r["shfl.sync"] == 0:
            bad.append("no shfl.sync (row max and row sum are warp shuffles)")
        if r["dtype"] == "float32" and r["ld.shared.v4"] == 0:
            bad.append("no ld.shared.v4 (128-bit shared loads) in a float32 kernel")
    if name.startswith((MMA + "/", MMA + "_split/")):
        for feature in ("mma.sync", "ldmatrix", "cp.async", "shfl.sync"):
            if r[feature] == 0:
                bad.append(f"no {feature} in the tensor-core forward")
    if name.startswith(MMA_BACKWARD):
        for feature in ("mma.sync", "ldmatrix", "cp.async"):
            if r[feature] == 0:
                bad.append(f"no {feature} in the tensor-core backward")
    # the softcap's tanh by the special-function unit (numba_flash.scores.SOFTCAP_TANH)
    if "softcap" in name.split("/")[3]:
        tanh = SOFTCAP_TANH[r["dtype"]]
        if tanh == "approx" and r["tanh.approx.f32"] == 0:
            bad.append("a 16-bit softcap kernel without tanh.approx.f32")
        if tanh == "rcp" and r["rcp.approx.f32"] == 0:
            bad.append("a float32 softcap kernel without rcp.approx.f32")
        if tanh == "exact" and r["tanh.approx.f32"] + r["rcp.approx.f32"]:
            bad.append("a float32 special-function tanh or reciprocal in a float64 kernel")
    # the Hopper forward's output written by straight-line stores (wgmma_parts.make_store_rows):
    # per thread two rows of 4 column quads per 64 columns of d (of d's columns only where the
    # kernel's head dim is padded: forward_wgmma.padded), and two lse values; a rolled
    # loop there picked the accumulator's registers by branching (docs/performance.md item 34)
    # (packed sequences: out and lse of any strides, stored through generic addresses); four
    # copies where an item's last P V overlaps the next item's start (forward_wgmma.overlaps:
    # the rows after the overlap, the block's last item's, and at each of the two places the
    # next item is sought, the rows of items with no key); elsewhere the rows once and lse
    # twice (taken while the item's last P V runs, and for items without a product)
    if name in HOPPER and name.startswith("forward_wgmma/"):
        d = int(name.split("/")[2][1:])
        stores = r["st.global"] + r["st.generic"]
        spec = SPECS[name]
        overlap = forward_wgmma.overlaps(spec.scores, spec.tiling.BM, d)
        want = (d // 8 + 2) * 4 if overlap else d // 8 + 2 * 2      # (d // 8: a row pair's stores of d columns)
        if stores != want:
            bad.append(f"{stores} stores, not {want}: the output stores are not unrolled")
    # exponentials on the FMA units (forward_wgmma.EXP2_FMA_SOFTCAP, measured slower) in
    # no Hopper forward of the registry
    if name in HOPPER and name.startswith("forward_wgmma/") and r["exp2_fma"]:
        bad.append(f"{r['exp2_fma']} exp2_fma (forward_wgmma.EXP2_FMA_SOFTCAP is 0)")
    return [f"{name}: {b}" for b in bad]


def test_every_specialisation_compiles_for_every_cc(ptx_runs):
    ccs = {r["cc"] for k in range(SHARDS) for r in _rows(ptx_runs, f"shard{k}")}
    assert ccs == set(BUILT)
    for cc in BUILT:
        names = [r["name"] for r in _cc_rows(ptx_runs, cc)]
        want = HOPPER if cc == "9.0a" else EXPECTED - HOPPER
        assert len(names) == len(set(names)), "a specialisation was compiled twice"
        assert set(names) == want, (f"cc {cc}: missing: {sorted(want - set(names))}; "
                                    f"unexpected: {sorted(set(names) - want)}")


@pytest.mark.parametrize("cc", BUILT)
def test_ptx_features(ptx_runs, cc):
    problems = [p for r in _cc_rows(ptx_runs, cc) for p in _check_row(r)]
    assert not problems, "\n".join(problems)


# Known spills, in bytes of spill stores at most: sm_80's register allocation of the
# float32 d <= 64 causal forward (8 x 8 scores per thread) spills a few words; sm_90's
# does not. Not yet measured on an sm_80 GPU. The float32 d <= 64 forward with a window,
# softcap or ALiBi (the same 8 x 8 tile, at 254 registers without them) spills up to 104
# bytes; the float64 d96 dK/dV kernel with plain loads 8-60 (since the score arguments
# and the GQA group loop). Measured on the H200: docs/performance.md.
KNOWN_SPILLS = {
    "8.0": {"forward_simt/float32/d32/causal/async": 64,
            "forward_simt/float32/d64/window/async": 72,
            "forward_simt/float32/d64/causal+softcap+alibi/async": 96,
            "forward_simt/float32/d64/window+softcap+alibi/async": 104,
            "forward_simt/float32/d64/window+softcap+alibi+packed/async": 16,
            # a paged cache's rows: a 64-bit division per 16-byte chunk on top of 255 registers
            "forward_simt/float32/d64/causal+packed+paged/async": 160,
            "backward_dkdv_simt/float64/d96/full/plain": 8,
            "backward_dkdv_simt/float64/d96/causal/plain": 60},
    "9.0": {"forward_simt/float32/d64/causal+softcap+alibi/async": 48,
            "forward_simt/float32/d64/causal+packed+paged/async": 160,
            "forward_simt/float32/d64/window+softcap+alibi/async": 56,
            "backward_dkdv_simt/float64/d96/full/plain": 8},
    # the dK/dV accumulators (128 registers at d = 128) with S, dP and the causal mask's
    # indices: 255 registers and a few spilled (docs/performance.md item 35). In the SASS all
    # of it is outside the main loop (4 STL before it, 2 LDL after it, 2 between set-up steps)
    "9.0a": {"backward_dkdv_wgmma/float16/d128/causal/async": 16,
             "backward_dkdv_wgmma/bfloat16/d128/causal/async": 16,
             # (packed rows with every rule spilled 28 bytes and causal rows at d = 64 in
             # 192-row blocks 12: none since the producer publishes their items, ptxas 13;
             # docs/performance.md items 71, 125)
             # (causal rows at 128 rows and d <= 128, the pairs schedule's, spilled 40-56 bytes
             # with a producer of 40 registers: none at forward_wgmma.PAIRS_PRODUCER_REGS, 56;
             # docs/performance.md items 62, 123)
             # d = 256, causal: the pairs schedule's producer of 40 registers leaves the
             # consumers, whose O takes 128, 76 bytes short (ptxas 13); in the SASS none in the
             # loop over key tiles, per work item only (docs/performance.md items 115, 121)
             "forward_wgmma/float16/d256/causal/async": 80,
             "forward_wgmma/bfloat16/d256/causal/async": 80,
             # d = 64, causal, 192-row blocks on the pairs schedule (forward_wgmma.PAIRS_WIDE):
             # the producer's 32 registers (the rest of the pool is the three consumers' 160
             # each) spill 96-120 bytes of its per-item arithmetic (ptxas 13; 120 with the
             # query tiles aligned to the sequence's end, forward_wgmma.END_ALIGNED_CAUSAL);
             # in the SASS no block with a spill holds an HGMMA or MUFU (docs/performance.md
             # items 140-142)
             "forward_wgmma/float16/d64/causal/async": 120,
             "forward_wgmma/bfloat16/d64/causal/async": 120,
             "forward_wgmma/float16/d64/causal+softcap/async": 104,
             "forward_wgmma/bfloat16/d64/causal+softcap/async": 104},
}


@pytest.mark.parametrize("cc", BUILT)
def test_no_register_spills(ptx_runs, cc):
    """Assembled by ptxas (when a CUDA toolkit provides it), no kernel spills registers or
    uses a stack frame: what the PTX's .local count cannot show, since ptxas allocates the
    registers (all production kernels are launched with launch_bounds (threads, 1)).
    Exceptions: ``KNOWN_SPILLS``, each with a ceiling."""
    rows = [r for r in _cc_rows(ptx_runs, cc) if "registers" in r]
    if not rows:
        pytest.skip("no ptxas on this machine (python -m numba_flash.ptx --ptxas found none)")
    assert len(rows) == len(_cc_rows(ptx_runs, cc)), "ptxas failed on some kernels"
    bad = [f"{r['name']}: {r['registers']} registers, {r['stack']} B stack, {r['spill_stores']} B spill stores, "
           f"{r['spill_loads']} B spill loads" for r in rows if r["stack"] or r["spill_stores"] or r["spill_loads"]
           if r["spill_stores"] > KNOWN_SPILLS.get(cc, {}).get(r["name"], -1)]
    assert not bad, "\n".join(bad)


def test_no_serialized_wgmma(ptx_runs):
    """ptxas keeps every Hopper kernel's warpgroup products asynchronous: none reports
    C7513 (products serialized, each waiting for the one before), which a branch around a
    product while another is in flight brings about (docs/performance.md item 68)."""
    rows = [r for r in _cc_rows(ptx_runs, "9.0a") if "registers" in r]
    if not rows:
        pytest.skip("no ptxas on this machine (python -m numba_flash.ptx --ptxas found none)")
    assert all("wgmma_serialized" in r for r in rows), [r["name"] for r in rows if "wgmma_serialized" not in r]
    assert not [r["name"] for r in rows if r["wgmma_serialized"]]


def test_no_write_races_a_wgmma_operand(ptx_runs):
    """No Hopper kernel's SASS writes a register a warpgroup product reads as its A operand
    before the wait for that product (``ptx.wgmma_operand_writes``; a rotated loop of the
    forward did, and gave NaN on an H100: docs/performance.md item 97). Needs nvdisasm
    (``NVDISASM``, PATH or a CUDA toolkit); skipped without it."""
    rows = [r for r in _cc_rows(ptx_runs, "9.0a") if "wgmma_operand_writes" in r]
    if not rows:
        pytest.skip("no nvdisasm on this machine (python -m numba_flash.ptx --sass found none)")
    assert not [(r["name"], r["wgmma_operand_writes"]) for r in rows if r["wgmma_operand_writes"]]


TRACED_PROBE = '''
import json
from numba_flash import ptx, registry
from numba_flash.kernels import forward_wgmma as F
from numba_flash.scores import ScoreSpec
cc, rows = (9, 0, "a"), []
for d, packed in ((128, False), (128, True), (64, True)):
    spec = registry.specialisation("forward_wgmma", "bfloat16", d, ScoreSpec(causal=True, packed=packed), True,
                                   simulator=False)
    # (the packed d = 64 kernel traced with published items: products serialised, ptxas 13)
    kern = F.make_forward_wgmma(spec.dtype, spec.d, spec.scores, bn=spec.tiling.BN, bm=spec.tiling.BM,
                                fixed_max=F.FIXED_MAX_SOFTCAP, trace=True, publish=None if d == 128 else False)
    code = ptx.compile_ptx(kern.py_func, spec.signature()[:-1] + ", int64[:, :, ::1])", [cc], (kern.threads, 1))[cc]
    ptxas = ptx.find_ptxas()
    serial = ptx.assemble(code, cc, ptxas, None)["wgmma_serialized"] if ptxas else None
    rows.append([d, packed, code.count("%clock64"), code.count("wgmma.mma_async"), serial])
print(json.dumps(rows))
'''


def test_traced_hopper_forward_compiles():
    """``make_forward_wgmma(trace=True)`` (``tools/trace_items.py``) compiles for sm_90a
    (causal rows at d = 128 and packed causal rows, both with the published items, and a
    packed causal kernel at d = 64 without them) with its ten cycle-counter stamps (a
    warpgroup's six, its K_0's and its item placed, the producer's two) and its products;
    where ptxas is found, they stay asynchronous (a stamp under a branch serialised the
    packed kernel's; with the published items ptxas 13 serialises the traced packed d = 64
    kernel's, which ``tools/trace_items.py`` then traces with the items off)."""
    rows = json.loads(probe_output("traced").strip().splitlines()[-1])
    assert [(r[0], r[1]) for r in rows] == [(128, False), (128, True), (64, True)]
    assert all(r[2] == 10 and r[3] >= 4 and r[4] is not True for r in rows), rows


# a Hopper forward option compiled for sm_90a at KERNELS (head dim, rules), the items not
# published ahead unless that is the option (the registry's runs compile the defaults);
# per kernel the counts of COUNTED in its PTX, then ptxas's serialisation and spill (None
# without ptxas)
OPTION_PROBE = '''
import json
from numba_flash import ptx, registry
from numba_flash.kernels import forward_wgmma as F
from numba_flash.scores import ScoreSpec
cc, rows = (9, 0, "a"), []
for d, rules in {kernels!r}:
    spec = registry.specialisation("forward_wgmma", "bfloat16", d, ScoreSpec(**rules), True, simulator=False, rows=4096)
    kern = F.make_forward_wgmma(spec.dtype, spec.d, spec.scores, bn=spec.tiling.BN, bm=spec.tiling.BM,
                                fixed_max=F.FIXED_MAX_SOFTCAP, **{{"publish_ahead": False, "{option}": {value!r}}})
    code = ptx.compile_ptx(kern.py_func, spec.signature(), [cc], (kern.threads, 1))[cc]
    ptxas = ptx.find_ptxas()
    info = ptx.assemble(code, cc, ptxas, None) if ptxas else {{}}
    rows.append([d, sorted(rules), *[code.count(c) for c in {counted!r}], info.get("wgmma_serialized"),
                 info.get("spill_stores")])
print(json.dumps(rows))
'''


# per option, what OPTION_PROBE counts in the PTX and the kernels it compiles: the
# published items on both consumer paths (a window at d = 128: one item at a time; causal
# packed rows at d = 64: the item overlap), packed units head by head where a varlen batch
# at d = 128 runs, items published ahead on both paths of packed rows, the softcap's tanh by
# a polynomial where bench.py variants' softcap row runs and at d = 64 (192-row blocks)
BOTH_PATHS = ((128, {"window": True}), (64, {"causal": True, "packed": True}))
PACKED_PATHS = ((128, {"causal": True, "packed": True}), (64, {"causal": True, "packed": True}))
OPTION_PROBES = {"publish": (("st.shared.v4.u32", "ld.shared.v4.u32", ".local"), BOTH_PATHS),
                 "head_major": ((".local",), PACKED_PATHS[:1]),
                 "publish_ahead": (("st.shared.v4.u32", "ld.shared.v4.u32", ".local"), PACKED_PATHS),
                 "tanh_poly": (("vote.sync.all", "tanh.approx.f32", ".local"),
                               ((128, {"softcap": True}), (64, {"softcap": True})))}
# the value each option is set to (else True): three of every four tanh by the polynomial
# (forward_wgmma.TANH_POLY's share at d = 64)
OPTION_VALUES = {"tanh_poly": 3}


def _probe_scripts():
    """The compile probes this module's tests read (:func:`probe_output`), by name."""
    options = {option: OPTION_PROBE.format(option=option, counted=counted, kernels=kernels,
                                           value=OPTION_VALUES.get(option, True))
               for option, (counted, kernels) in OPTION_PROBES.items()}
    return {"traced": TRACED_PROBE, **options}


def _option_rows(option):
    """:data:`OPTION_PROBE`'s rows for ``make_forward_wgmma``'s ``option`` set, after
    checking which kernels it compiled and that ptxas (where found) neither serialised a
    product nor spilled: the counts of ``OPTION_PROBES[option]``'s strings per kernel."""
    rows = json.loads(probe_output(option).strip().splitlines()[-1])
    assert [(r[0], r[1]) for r in rows] == [(d, sorted(rules)) for d, rules in OPTION_PROBES[option][1]]
    assert all(r[-2] is not True and not r[-1] for r in rows), rows
    return [r[2:-2] for r in rows]


def test_published_items_compile():
    """``make_forward_wgmma(publish=True)`` (by default where ``forward_wgmma.publishes``)
    compiles for sm_90a on both consumer paths (:data:`OPTION_PROBE`): the producer's two
    16-byte stores per item, the consumers' two loads per place they take an item (the
    overlap path takes them in two places), nothing in local memory. (The simulator's bits
    test runs causal rows at d = 64 too.)"""
    assert _option_rows("publish") == [[2, 2, 0], [2, 4, 0]]


def test_items_published_ahead_compile():
    """``make_forward_wgmma(publish_ahead=True)`` (``forward_wgmma.publishes_ahead``: packed rows)
    compiles for sm_90a on both consumer paths of packed rows (causal at d = 128: one item
    at a time; at d = 64: the item overlap): the producer's three 16-byte stores (the slot
    and its key row) at each of the two places it publishes (the block's first item, then
    each next one ahead) and its three loads to read an item back, the consumers' two
    loads per place they take an item, nothing in local memory; ptxas neither serialises
    a product nor spills. (Unpacked causal rows and windows spill 4-32 bytes with it, in
    the producer's placing: docs/performance.md item 134.)"""
    assert _option_rows("publish_ahead") == [[6, 5, 0], [6, 7, 0]]


def test_packed_head_major_compiles():
    """``make_forward_wgmma(head_major=True)`` (``forward_wgmma.PACKED_HEAD_MAJOR``, on)
    compiles for sm_90a where the varlen batch of bench.py serving runs (causal packed rows
    at d = 128, one item at a time) with nothing in local memory, and ptxas neither
    serialises a product nor spills."""
    assert _option_rows("head_major") == [[0]]


def test_softcap_tanh_polynomial_compiles():
    """``make_forward_wgmma(tanh_poly=3)`` (``forward_wgmma.TANH_POLY``: 3 of every four
    scores by the polynomial, d = 64's share) compiles for sm_90a where a softcap alone runs
    at d = 128 (full rows) and at d = 64 (192-row blocks): each key tile's softmax (the
    item's first tile and the loop's) votes once and keeps tanh.approx for the other
    quarter of the scores (16 a tile) and for the warps that fall back (64 a tile), nothing
    in local memory; ptxas neither serialises a product across the vote's branch nor
    spills."""
    assert _option_rows("tanh_poly") == [[2, 160, 0], [2, 160, 0]]


def test_assemble_reads_wgmma_serialization(monkeypatch):
    """``ptx.assemble`` reports ptxas's C7513 (its words as ptxas 13.0 prints them) for
    kernels with warpgroup products, and only for those."""
    import subprocess
    from types import SimpleNamespace
    from numba_flash import ptx
    tail = ("ptxas info    : Used 168 registers, used 16 barriers\n"
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    warning = ("ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized "
               "due to non wgmma instructions defining input registers of a wgmma between start and end of the "
               "pipeline stage in the function 'k'\n")
    for stderr, text, want in ((warning + tail, "wgmma.mma_async.sync", True), (tail, "wgmma.mma_async.sync", False),
                               (warning + tail, "mma.sync", None)):
        monkeypatch.setattr(subprocess, "run", lambda *a, _e=stderr, **kw: SimpleNamespace(returncode=0, stderr=_e,
                                                                                             stdout=""))
        info = ptx.assemble(text, (9, 0, "a"), "ptxas")
        assert info.get("wgmma_serialized") is want and info["registers"] == 168, (want, info)


def test_forward_ptx_is_covered():
    """The forward variant is registered with both dtypes, every rule set (packed rows and
    paged caches included) and both load paths."""
    fwd = [s for s in registry.specialisations() if s.variant == FORWARD]
    assert {s.dtype for s in fwd} == set(registry.VARIANTS[FORWARD].dtypes)
    assert {s.scores for s in fwd} == set(SCORE_SPECS + RULE_SPECS + PACKED_SPECS + PAGED_SPECS)
    assert {s.use_async for s in fwd} == {False, True}


def _family_calls():
    """``(name, call)`` of API calls (tiny, random) that between them launch every kernel
    family: forward, decoding with key splits, backward, packed rows, KV caches (paged,
    with appends), merges, grouped heads with every score rule."""
    import ml_dtypes
    import numpy as np
    import numba_flash
    from numba import cuda
    from numba_flash import api
    rng = np.random.default_rng(11)

    def draw(*shape, dt=np.float32):
        return rng.standard_normal(shape).astype(dt)

    def pair(dt, d, n=40):                    # q, k, v, dout of one shape, then the forward's out, lse
        q, k, v, do = (draw(1, 2, n, d, dt=dt) for _ in range(4))
        return (do, q, k, v, *numba_flash.attention_fwd(q, k, v, causal=True))

    bf = ml_dtypes.bfloat16
    cu = np.array([0, 20, 50], np.int32)
    return [
        ("forward float32", lambda: numba_flash.attention_fwd(*(draw(1, 2, 40, 16) for _ in range(3)), causal=True)),
        ("forward bfloat16", lambda: numba_flash.attention_fwd(*(draw(1, 2, 40, 64, dt=bf) for _ in range(3)))),
        ("key splits float32", lambda: [api.launch(*a) for a in api.plan_forward(
            draw(1, 1, 1, 16), draw(1, 1, 300, 16), draw(1, 1, 300, 16), splits=3)[1]]),
        ("decoding bfloat16", lambda: numba_flash.attention_fwd(draw(2, 2, 1, 64, dt=bf), *(draw(2, 2, 300, 64, dt=bf)
                                                                                         for _ in range(2)))),
        ("backward float32", lambda: numba_flash.attention_bwd(*pair(np.float32, 16), causal=True)),
        ("backward bfloat16", lambda: numba_flash.attention_bwd(*pair(bf, 64), causal=True)),
        ("varlen float32, one head", lambda: numba_flash.attention_varlen_fwd(
            *(draw(50, 1, 16) for _ in range(3)), cu, cu, causal=True)),
        ("varlen bfloat16", lambda: numba_flash.attention_varlen_fwd(*(draw(50, 2, 64, dt=bf) for _ in range(3)),
                                                                     cu, cu, causal=True)),
        ("varlen bfloat16, one head", lambda: numba_flash.attention_varlen_fwd(
            *(draw(50, 1, 64, dt=bf) for _ in range(3)), cu, cu)),
        ("varlen bfloat16, grouped heads", lambda: numba_flash.attention_varlen_fwd(
            draw(50, 4, 64, dt=bf), draw(50, 2, 64, dt=bf), draw(50, 2, 64, dt=bf), cu, cu, causal=True)),
        ("paged KV cache", lambda: numba_flash.attention_with_kvcache(
            draw(2, 1, 2, 64, dt=bf), draw(8, 16, 2, 64, dt=bf), draw(8, 16, 2, 64, dt=bf), np.array([20, 5], np.int32),
            k_new=draw(2, 1, 2, 64, dt=bf), v_new=draw(2, 1, 2, 64, dt=bf),
            block_table=np.array([[3, 1, 0], [2, 5, 4]], np.int32))),
        ("KV cache float32", lambda: numba_flash.attention_with_kvcache(
            draw(2, 1, 2, 16), draw(2, 64, 2, 16), draw(2, 64, 2, 16), np.array([20, 5], np.int32),
            k_new=draw(2, 1, 2, 16), v_new=draw(2, 1, 2, 16))),
        ("merge", lambda: numba_flash.merge_attention([cuda.to_device(draw(1, 2, 10, 16)) for _ in range(2)],
                                                      [cuda.to_device(draw(1, 2, 10)) for _ in range(2)])),
        ("strided bfloat16", lambda: numba_flash.attention_fwd(*(draw(1, 2, 40, 128, dt=bf)[..., ::2] for _ in range(3)))),
        ("paged KV cache, device metadata", lambda: numba_flash.attention_with_kvcache(
            numba_flash.to_device(draw(2, 1, 2, 64, dt=bf)), numba_flash.to_device(draw(8, 16, 2, 64, dt=bf)),
            numba_flash.to_device(draw(8, 16, 2, 64, dt=bf)), cuda.to_device(np.array([20, 5], np.int32)),
            k_new=numba_flash.to_device(draw(2, 1, 2, 64, dt=bf)), v_new=numba_flash.to_device(draw(2, 1, 2, 64, dt=bf)),
            block_table=cuda.to_device(np.array([[3, 1, 0], [2, 5, 4]], np.int32)), check_metadata=False)),
        ("grouped heads, window, softcap, ALiBi", lambda: numba_flash.attention_fwd(
            draw(1, 4, 40, 64, dt=bf), draw(1, 2, 40, 64, dt=bf), draw(1, 2, 40, 64, dt=bf), window=(5, 2),
            softcap=3.0, alibi_slopes=np.ones(4, np.float32))),
    ]


@pytest.mark.parametrize("hopper", ["0", "1"], ids=["hopper-off", "hopper-on"])
def test_launches_take_the_compiled_types(hopper, monkeypatch):
    """Every launch of :func:`_family_calls` passes arguments of the types of one of its
    specialisation's signatures (``Specialisation.signature``, layout C or A), the kernels
    the PTX tests compile and check, but that an array may be C where the signature says A
    (Numba then compiles the same code with constant strides: the general kernel is the one
    checked; grouped heads' K and V, read through a stride-0 axis, are A beside a C q). An
    argument of another type makes Numba compile a kernel no offline check sees (packed
    rows' out and lse on the Hopper forward were typed A by a zero stride on an axis of one
    index, against the signature's C: docs/performance.md item 132). Launches recorded, not
    run; the Hopper family forced on and off (on, on a GPU of compute capability 9.0 only)."""
    from numba import cuda, typeof
    from numba.core import sigutils, types
    from numba_flash import _kernel_cache, api
    if hopper == "1" and ON_GPU and tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, hopper)
    seen = {}
    monkeypatch.setattr(api, "launch", lambda kern, grid, block, smem, args, *rest: seen.setdefault(
        _kernel_cache.kernel_name(kern), (kern, args)))

    def fits(got, layout):
        want = sigutils.normalize_signature(spec.signature(layout))[0]
        return len(got) == len(want) and all(
            (isinstance(w, types.Array) and isinstance(g, types.Array) and (g.dtype, g.ndim) == (w.dtype, w.ndim)
             and w.layout in (g.layout, "A")) or (not isinstance(w, types.Array) and g == w)
            for g, w in zip(got, want))

    bad, variants = [], set()
    for name, call in _family_calls():
        seen.clear()
        call()
        assert seen, name
        for kname, (kern, args) in seen.items():
            spec = _kernel_cache.kernel_identity(kern)
            assert isinstance(spec, registry.Specialisation), (name, kname)
            variants.add(spec.variant)
            got = [typeof(a) for a in args]
            if not (fits(got, "C") or fits(got, "A")):
                bad.append(f"{name}: {kname} launched with {got}, signature {spec.signature()}")
    assert not bad, "\n".join(bad)
    want = {"forward_simt", "forward_mma_split", "backward_delta", "backward_dkdv_simt", "backward_dq_simt",
            "backward_stats", "forward_merge"}
    want |= ({"forward_wgmma", "backward_dkdv_wgmma", "backward_dq_wgmma"} if hopper == "1"
             else {"forward_mma", "backward_dkdv_mma", "backward_dq_mma"})
    assert want <= variants, (sorted(want - variants), sorted(variants))


def test_tensor_core_ptx_is_covered():
    """Both 16-bit dtypes, every rule set, and each fast-path head dim get their own PTX check."""
    mma = [s for s in registry.specialisations() if s.variant == MMA]
    assert {s.dtype for s in mma} == set(registry.LOW_DTYPES)
    assert {s.scores for s in mma} == set(SCORE_SPECS + RULE_SPECS + PACKED_SPECS + PAGED_SPECS)
    assert set(registry.MMA_FAST_DIMS) <= {s.d for s in mma}
    split = [s for s in registry.specialisations() if s.variant == "forward_mma_split"]
    assert {s.scores for s in split} == set(SCORE_SPECS + PACKED_SPECS + PAGED_SPECS)


@pytest.mark.parametrize("dtype", sorted(ONLY_A))
def test_layout_a(ptx_runs, dtype):
    """Arbitrary-stride (layout A) q, k, v compile to the same kind of PTX (and the command,
    run without NUMBA_ENABLE_CUDASIM as a user would, writes the files ``--out`` asks for)."""
    rows = _rows(ptx_runs, f"layoutA-{dtype}")
    assert {r["layout"] for r in rows} == {"A"}
    names = {r["name"] for r in rows}
    assert names == {n for n in EXPECTED if ONLY_A[dtype] in n}
    written = sorted(os.listdir(os.path.join(OUT_DIR, f"layoutA-{dtype}")))     # --out
    assert len(written) == len(names) and all(f.endswith(".sm_90.ptx") for f in written)
    problems = [p for r in rows for p in _check_row(r)]
    assert not problems, "\n".join(problems)


SASS_SAMPLE = """
        /*0100*/                   LDS R4, [R2] ;
        /*0110*/                   FFMA R8, R4, R5, R8 ;
.L_x_3:
        /*0120*/                   LDS.128 R4, [R2+0x10] ;
        /*0130*/              @!P0 IMAD.IADD R9, R9, 0x1, R3 ;
""" + "".join(f"        /*{0x140 + 16 * i:04x}*/                   FFMA R{i % 8}, R4, R5, R{i % 8} ;\n"
              for i in range(16)) + """
        /*0240*/                   HMMA.1688.F32.TF32 R20, R4, R8, R20 ;
.L_x_4:
        /*0250*/                   EXIT ;
"""


def test_cli_arguments():
    """Host-only: --shard and --cc parsing, and the names --out gives the files."""
    from numba_flash import ptx
    assert ptx._parse_shard("1/3") == (1, 3)
    assert ptx._parse_ccs("8.0,9.0") == ((8, 0), (9, 0))
    assert ptx._parse_ccs("9.0a") == ((9, 0, "a"),) and ptx._file_stem("k", (9, 0, "a")) == "k.sm_90a"
    for bad in ("3/3", "x", "-1/2"):
        with pytest.raises(Exception, match="K/N"):
            ptx._parse_shard(bad)
    with pytest.raises(Exception, match="compute capabilities"):
        ptx._parse_ccs("9")
    assert ptx._file_stem("forward_mma/bfloat16/d64/full/async", (9, 0)) == "forward_mma_bfloat16_d64_full_async.sm_90"


def test_hot_blocks_reads_an_nvdisasm_listing():
    """--sass's report of the blocks that do the arithmetic (host-only: a canned listing)."""
    from numba_flash.ptx import hot_blocks
    blocks = hot_blocks(SASS_SAMPLE)
    assert blocks == [{"instructions": 19, "fma": 17, "per_fma": round(19 / 17, 2),
                       "mix": {"FFMA": 16, "LDS": 1, "IMAD": 1, "HMMA": 1}}]
    assert hot_blocks(SASS_SAMPLE, min_fma=100) == []


WGMMA_SAMPLE = """
        /*0100*/                   WARPGROUP.ARRIVE ;
        /*0110*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR16].tnspB, R88 ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR16].tnspB, R88, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0140*/                   FMNMX R7, R25, R24, !PT ;
        /*0150*/                   STS.128 [UR11], R152 ;
        /*0160*/              @P0  F2FP.BF16.F32.PACK_AB R157, R25, R24 ;
        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0180*/                   F2FP.BF16.F32.PACK_AB R152, R25, R24 ;
"""


def test_wgmma_operand_writes_reads_an_nvdisasm_listing():
    """``ptx.wgmma_operand_writes`` flags a write to a register an HGMMA reads as its A
    operand (R152..R159 here) before the wait for that product (0x0), and nothing else: not
    a store of it, not a register outside, not a write after the wait (host-only: a canned
    listing; ``python -m numba_flash.ptx --ptxas --sass`` counts them per Hopper kernel)."""
    from numba_flash.ptx import wgmma_operand_writes
    found = wgmma_operand_writes(WGMMA_SAMPLE)
    assert found == [(0x160, "@P0  F2FP.BF16.F32.PACK_AB R157, R25, R24", 0x120)]


def test_exponentials_between_waits_reads_an_nvdisasm_listing():
    """``ptx.exponentials_between_waits`` counts, per wait for S (0x1), the MUFU.EX2 issued
    before the wait for P V (0x0): the softmax that runs while P V does."""
    from numba_flash.ptx import exponentials_between_waits
    overlapped = WGMMA_SAMPLE.replace("FMNMX R7, R25, R24, !PT", "MUFU.EX2 R7, R25")
    late = WGMMA_SAMPLE + "        /*0190*/                   MUFU.EX2 R8, R26 ;\n"
    assert exponentials_between_waits(overlapped) == [1]
    assert exponentials_between_waits(late) == [0]
    assert exponentials_between_waits(late + overlapped) == [0, 1]


def test_registry_is_the_source_of_dtypes():
    """Each direction's dtypes are those of the families registered for it (what the API
    accepts, and what the tests and bench.py enumerate)."""
    assert registry.dtypes("forward") == registry.DTYPES + registry.LOW_DTYPES
    assert registry.dtypes("backward") == registry.DTYPES + registry.LOW_DTYPES
    assert {v.direction for v in registry.VARIANTS.values()} == {"forward", "backward", None}
    with pytest.raises(ValueError, match="direction must be one of"):
        registry.dtypes("sideways")
