"""numba_flash.ops_hopper compiles for sm_90a without a GPU: a kernel using every intrinsic
(TMA into shared memory on an mbarrier, warpgroup MMAs with A from shared memory and from
registers, register reallocation, a named barrier) becomes the Hopper instructions, and
ptxas (where installed) assembles it with no local memory.

The compile runs in a subprocess (this file as a script), as ``python -m numba_flash.ptx``
does: the simulator, which the test-suite runs in without a GPU, cannot compile.
"""
import json
import os
import re
import subprocess
import sys

import pytest

if __name__ != "__main__":
    from conftest import HANG_GUARD_S, process_failure, project_env
    from numba import cuda       # after conftest imported numba_flash (which picks GPU or simulator)

N = 64          # accumulator columns of the sample products


def sample_kernel():
    import numba
    from numba import cuda, types
    from numba_flash import ops_hopper as H

    mma_ss = H.wgmma(N, "bfloat16")
    mma_rs = H.wgmma(N, "bfloat16", a_in_registers=True, trans_b=1)
    zeros = H.accumulator(N)
    desc = H.smem_descriptor(16, 1024, 1)
    give, take = H.setmaxnreg(40, False), H.setmaxnreg(232, True)
    wait0 = H.wgmma_wait(0)

    def kern(tmap, out):
        sm = cuda.shared.array(0, types.uint8, alignment=1024)
        tid = cuda.threadIdx.x
        base = (H.shared_address(sm) + 1023) & ~1023
        bar = base + 16384
        if tid == 0:
            H.mbarrier_init(bar, 1)
            H.fence_mbarrier_init()
        cuda.syncthreads()
        if tid >= 128:                  # producer warpgroup: one thread issues the copy
            give()
            if tid == 128:
                H.tensormap_acquire(H.global_address(tmap))
                H.mbarrier_arrive_expect_tx(bar, 16384)
                H.tma_load_3d(base, H.global_address(tmap), 0, 0, 0, bar)
                H.tma_load_4d(base + 8192, H.global_address(tmap), 0, 0, 0, 0, bar)
        else:                           # consumer warpgroup
            take()
            while H.mbarrier_try_wait(bar, 0) == 0:
                pass
            H.wgmma_fence()
            acc = mma_ss(zeros(), desc(base), desc(base + 8192), 0)
            acc = mma_ss(acc, desc(base + 32), desc(base + 8192 + 32), 1)
            acc = mma_rs(acc, numba.uint32(1), numba.uint32(2), numba.uint32(3), numba.uint32(4), desc(base), 1)
            H.wgmma_commit()
            wait0()
            acc = H.scale_rows(acc, numba.float32(0.5), numba.float32(2.0))
            H.named_barrier(1, 128)
            for i in range(N // 2):
                out[tid, i] = acc[i]
    return kern, (types.uint8[::1], types.float32[:, ::1])


# The layouts the Hopper forward relies on (docs/hopper.md), in one block: Q (64 × 128) and
# K, V (128 × 128, rows past the array's end zero-filled by TMA) in 64-column sub-tiles with
# the 128-byte swizzle; S = Q Kᵀ by m64n128k16 products from shared memory; O = P V with P
# (S rounded to bf16) from registers and V as a transposed (MN-major) B, two m64n64k16 per
# 16 keys, and again one m64n128k16 per 16 keys whose descriptor's leading byte offset spans
# both sub-tiles (``wgmma_parts.make_column_product``). Byte sizes: a 64-column sub-tile of R
# rows is R · 128.
LM, LN, LD = 64, 128, 128
SUB_Q, SUB_K = LM * 128, LN * 128
Q_OFF, K_OFF, V_OFF = 0, 2 * SUB_Q, 2 * SUB_Q + 2 * SUB_K
LAYOUT_BAR = V_OFF + 2 * SUB_K
LAYOUT_SMEM = LAYOUT_BAR + 8 + 1024            # the barrier, and room to align the base to 1024


def layout_kernel():
    global cuda                  # a module global: the simulator swaps a kernel's global ``cuda``, not a closure's
    from numba import cuda, types
    from numba_flash import ops
    from numba_flash import ops_hopper as H

    s_mma = H.wgmma(LN, "bfloat16")
    o_mma = H.wgmma(64, "bfloat16", a_in_registers=True, trans_b=1)
    wide_mma = H.wgmma(LD, "bfloat16", a_in_registers=True, trans_b=1)
    zeros_s, zeros_o, zeros_wide = H.accumulator(LN), H.accumulator(64), H.accumulator(LD)
    k_major = H.smem_descriptor(16, 1024, 1)
    mn_major = H.smem_descriptor(16, 1024, 1)
    mn_wide = H.smem_descriptor(SUB_K, 1024, 1)       # LBO: the second 64-column atom, a sub-tile on
    wait0 = H.wgmma_wait(0)
    pack = ops.pack_bf16x2

    def kern(tq, tk, tv, s_out, o_out, wide_out):
        sm = cuda.shared.array(0, types.uint8, alignment=1024)
        tid = cuda.threadIdx.x
        base = (H.shared_address(sm) + 1023) & ~1023
        bar = base + LAYOUT_BAR
        if tid == 0:
            H.mbarrier_init(bar, 1)
            H.fence_mbarrier_init()
        cuda.syncthreads()
        if tid >= 128:
            if tid == 128:
                H.tensormap_acquire(H.global_address(tq))
                H.tensormap_acquire(H.global_address(tk))
                H.tensormap_acquire(H.global_address(tv))
                H.mbarrier_arrive_expect_tx(bar, 2 * SUB_Q + 4 * SUB_K)
                for sub in range(2):
                    H.tma_load_4d(base + Q_OFF + sub * SUB_Q, H.global_address(tq), 64 * sub, 0, 0, 0, bar)
                    H.tma_load_4d(base + K_OFF + sub * SUB_K, H.global_address(tk), 64 * sub, 0, 0, 0, bar)
                    H.tma_load_4d(base + V_OFF + sub * SUB_K, H.global_address(tv), 64 * sub, 0, 0, 0, bar)
        else:
            while H.mbarrier_try_wait(bar, 0) == 0:
                pass
            H.wgmma_fence()
            s = zeros_s()
            for ks in range(LD // 16):
                off = (ks // 4) * SUB_Q + 32 * (ks % 4)
                koff = (ks // 4) * SUB_K + 32 * (ks % 4)
                s = s_mma(s, k_major(base + Q_OFF + off), k_major(base + K_OFF + koff), 1 if ks > 0 else 0)
            H.wgmma_commit()
            wait0()
            w, g, q = tid // 32, (tid % 32) // 4, tid % 4
            for i in range(LN // 2):
                s_out[16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * q + i % 2] = s[i]
            H.wgmma_fence()
            o0, o1 = zeros_o(), zeros_o()
            for t in range(LN // 16):
                a0, a1 = pack(s[8 * t], s[8 * t + 1]), pack(s[8 * t + 2], s[8 * t + 3])
                a2, a3 = pack(s[8 * t + 4], s[8 * t + 5]), pack(s[8 * t + 6], s[8 * t + 7])
                acc = 1 if t > 0 else 0
                o0 = o_mma(o0, a0, a1, a2, a3, mn_major(base + V_OFF + 2048 * t), acc)
                o1 = o_mma(o1, a0, a1, a2, a3, mn_major(base + V_OFF + SUB_K + 2048 * t), acc)
            H.wgmma_commit()
            wait0()
            for i in range(32):
                r, c = 16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * q + i % 2
                o_out[r, c] = o0[i]
                o_out[r, 64 + c] = o1[i]
            H.wgmma_fence()
            o = zeros_wide()
            for t in range(LN // 16):
                a0, a1 = pack(s[8 * t], s[8 * t + 1]), pack(s[8 * t + 2], s[8 * t + 3])
                a2, a3 = pack(s[8 * t + 4], s[8 * t + 5]), pack(s[8 * t + 6], s[8 * t + 7])
                o = wide_mma(o, a0, a1, a2, a3, mn_wide(base + V_OFF + 2048 * t), 1 if t > 0 else 0)
            H.wgmma_commit()
            wait0()
            for i in range(LD // 2):
                wide_out[16 * w + g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * q + i % 2] = o[i]
    return kern, (types.uint8[::1], types.uint8[::1], types.uint8[::1], types.float32[:, ::1],
                  types.float32[:, ::1], types.float32[:, ::1])


def forward_drafts(ptx, cc, tool):
    """{d: (wgmma count, local memory, spill bytes)} of the Hopper forward's first draft."""
    from numba import types as T
    from numba_flash.kernels.forward_wgmma import make_forward_wgmma
    from numba_flash.scores import ScoreSpec
    sig = (T.uint8[::1], T.uint8[::1], T.uint8[::1], T.uint64[:, :, :, ::1], T.float32[:, :, ::1], T.int64, T.int64,
           T.float32, T.int64, T.int64, T.float32, T.float32, T.float32[:, :, :], T.int64)
    found = {}
    for d, scores in ((64, ScoreSpec(causal=True)), (128, ScoreSpec())):
        kern = make_forward_wgmma("bfloat16", d, scores)
        text = ptx.compile_ptx(kern.py_func, sig, [cc], launch_bounds=(kern.threads, 1))[cc]
        spills = ptx.assemble(text, cc, tool).get("spill_stores") if tool else None
        found[d] = (text.count("wgmma.mma_async"), text.count(".local"), spills, f"forward_wgmma/bfloat16/d{d}/{scores.tag}/async")
    return found


def main():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from numba_flash import ptx
    kern, sig = sample_kernel()
    cc = (9, 0, "a")
    layout = ptx.compile_ptx(*layout_kernel(), [cc], launch_bounds=(256, 1))[cc]
    text = ptx.compile_ptx(kern, sig, [cc], launch_bounds=(256, 1))[cc]
    report = {"target": re.findall(r"^\.target\s+(\S+)", text, re.M),
              **{k: text.count(k) for k in ("wgmma.mma_async", "cp.async.bulk.tensor.3d", "cp.async.bulk.tensor.4d",
                                            "mbarrier.try_wait", "setmaxnreg", "bar.sync", ".local")}}
    tool = ptx.find_ptxas()
    report["forward"] = forward_drafts(ptx, cc, tool)
    if tool:
        info = ptx.assemble(text, cc, tool)
        report["assembled"] = bool(info)
        report.update({k: info[k] for k in ("registers", "spill_stores") if k in info})
    report["layout_wgmma"] = layout.count("wgmma.mma_async")
    report["layout_local"] = layout.count(".local")
    print(json.dumps(report))


def test_hopper_intrinsics_compile_for_sm_90a():
    proc = subprocess.run([sys.executable, __file__], env=project_env(NUMBA_ENABLE_CUDASIM="0"),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, process_failure(proc)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["target"] == ["sm_90a"]
    assert report["wgmma.mma_async"] == 3 and report["cp.async.bulk.tensor.3d"] == 1
    assert report["cp.async.bulk.tensor.4d"] == 1
    assert report["mbarrier.try_wait"] >= 1 and report["setmaxnreg"] == 2 and report["bar.sync"] >= 1
    assert report[".local"] == 0, "the accumulator tuple must stay in registers"
    assert report["layout_wgmma"] >= 3 and report["layout_local"] == 0, report
    # S = Q Kᵀ: d / 16 products, O += P V: 8 per 64 columns of d (128-key tiles), each written
    # twice (tile 0's S before the loop, the last P V after it): unrolled, in registers
    from test_ptx import KNOWN_SPILLS
    for d, (mmas, local, spills, name) in report["forward"].items():
        # per product site: S = Q Kᵀ in d / 16 k-steps, P V in one per 16 of the tile's 128 keys
        assert mmas == 2 * (int(d) // 16 + 8) and local == 0, (d, report)
        assert spills is None or spills <= KNOWN_SPILLS["9.0a"].get(name, 0), (d, report)
    if "assembled" not in report:
        pytest.skip("no ptxas: PTX checked, not assembled")
    assert report["assembled"] and report.get("spill_stores", 0) == 0, report


def _hopper_gpu():
    import numba_flash
    if numba_flash.SIMULATOR:
        return False
    from numba import cuda
    return cuda.get_current_device().compute_capability == (9, 0)


def check_layouts():
    """TMA with zero fill, K-major and MN-major descriptors with the 128-byte swizzle, A from
    registers: S and O of the layout kernel against NumPy (float64 of the bf16 inputs; P is
    the kernel's own S rounded to bf16)."""
    import ml_dtypes
    import numpy as np
    from numba import cuda
    from numba_flash import ops_hopper as H
    from numba_flash.launch import launch

    rng = np.random.default_rng(0)
    nk = 100                                            # rows 100..127 of the K and V boxes: zero fill
    q = rng.standard_normal((1, 1, LM, LD)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 1, nk, LD)).astype(ml_dtypes.bfloat16) for _ in range(2))
    dq, dk, dv = (cuda.to_device(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    tq, tk, tv = H.tensor_map_4d(dq, LM), H.tensor_map_4d(dk, LN), H.tensor_map_4d(dv, LN)
    s_out, o_out, wide_out = (cuda.to_device(np.full((LM, n), np.nan, np.float32)) for n in (LN, LD, LD))
    kern, _ = layout_kernel()
    launch(cuda.jit(launch_bounds=(256, 1))(kern), 1, 256, LAYOUT_SMEM, (tq, tk, tv, s_out, o_out, wide_out))
    s, o = s_out.copy_to_host(), o_out.copy_to_host()
    f64 = lambda x: x.astype(np.float64)[0, 0]          # noqa: E731
    kz = np.zeros((LN, LD))
    kz[:nk] = f64(k)
    vz = np.zeros((LN, LD))
    vz[:nk] = f64(v)
    np.testing.assert_allclose(s, f64(q) @ kz.T, rtol=1e-5, atol=1e-4)
    p = s.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(o, p @ vz, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(wide_out.copy_to_host(), o, rtol=1e-6, atol=1e-6)   # the same products


# The forward kernel's parameters, in order: a kernel that takes others needs this test updated.
FORWARD_PARAMS = ("tq", "tk", "tv", "out", "lse", "nk", "group", "scale_log2", "left", "right", "cap_in",
                  "cap_out", "slopes", "sched")


def check_forward(d, causal, nq, nk, heads, grid=None, bn=None, sched=None, window=None):
    """The Hopper forward (``kernels/forward_wgmma``, launched with its own ``BM``, ``BN``,
    ``THREADS`` and ``smem_bytes``) on bf16 inputs of ``heads = (B1, B2)`` against the float64 oracle (the
    FlashAttention rule of the tensor-core tests: outputs within a few units of the last place).
    ``grid``: blocks launched (default: one per work item; fewer make each block take several);
    ``bn``: keys per tile (default the family's; with wider tiles 128 query rows, as
    192 rows of each would not fit in shared memory); ``window``: the public option."""
    import inspect
    import math
    import ml_dtypes
    import numpy as np
    from numba import cuda
    from numba_flash import ops_hopper as H
    from numba_flash import _arrays, reference
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.kernels import wgmma_schedule as S
    from numba_flash.launch import launch
    from numba_flash.scores import LOG2E, parse

    rules = parse(causal=causal, window=window)
    bn = bn or F.BN
    bm = F.tiling(d, rules.spec).BM if bn == F.BN else F.BM
    kern = F.make_forward_wgmma("bfloat16", d, rules.spec, bn=bn, bm=bm)
    params = tuple(inspect.signature(kern.py_func).parameters)
    if params != FORWARD_PARAMS:
        pytest.skip(f"the forward kernel's parameters changed to {params}: update check_forward")
    rng = np.random.default_rng(d + nq)
    q = rng.standard_normal((*heads, nq, d)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((*heads, nk, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    dq, dk, dv = (cuda.to_device(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v))
    maps = [H.tensor_map_4d(x, rows) for x, rows in ((dq, bm), (dk, bn), (dv, bn))]
    out = cuda.to_device(np.full((*heads, nq, d), 0x7FC0, np.uint16))          # NaN bits
    packed = _arrays.packed_view(out)
    lse = cuda.to_device(np.full((*heads, nq), np.nan, np.float32))
    slopes = cuda.to_device(np.zeros((*heads, 1), np.float32))
    scale = 1 / math.sqrt(d)
    grid = grid or -(-nq // bm) * heads[0] * heads[1]
    if sched is None:       # the schedule a launch would take (the pairs of causal rows, where they pay)
        sched = F.schedule(rules, bm, nq, nk, heads[0] * heads[1], grid, S.L2_KV_BYTES + 1)
    args = (*maps, packed, lse, nk, 1, np.float32(scale * LOG2E), *rules.band(), np.float32(0), np.float32(0), slopes,
            sched)
    launch(kern, grid, kern.threads, kern.smem_bytes, args)
    got = out.copy_to_host().view(ml_dtypes.bfloat16).astype(np.float64)
    want, want_lse = reference.attention_fwd(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                                             window=window)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse.copy_to_host(), want_lse, atol=1e-3, rtol=1e-3)


def test_wgmma_layouts_on_gpu():
    if not _hopper_gpu():
        pytest.skip("the Hopper instructions run on compute capability 9.0 only")
    check_layouts()


@pytest.mark.parametrize("d,causal,nq,nk", [(64, True, 200, 333), (128, False, 130, 77), (128, True, 64, 64)])
def test_forward_draft_on_gpu(d, causal, nq, nk):
    if not _hopper_gpu():
        pytest.skip("the Hopper instructions run on compute capability 9.0 only")
    check_forward(d, causal, nq, nk, (2, 3))


@pytest.mark.parametrize("d,causal,nq,nk,heads,grid,bn,window", [
    (64, True, 300, 100, (1, 2), 2, None, None),    # items without keys between others; rounds dealt both ways
    (128, False, 200, 140, (1, 2), 2, None, None),  # query tiles fastest; the ring runs on across items
    (64, True, 200, 450, (1, 2), 2, 192, None),     # 192-key tiles: the diagonal inside a tile, a ragged last one
    (64, True, 420, 400, (1, 1), 2, None, (200, None)),  # a window: 1 to 4 key tiles per item
])
def test_forward_persistent_blocks(d, causal, nq, nk, heads, grid, bn, window):
    """Blocks that take several work items each (``grid`` below the item count): Q's and
    the ring's barriers across items, items that see no key, the causal schedule's rounds,
    a window's band across items; in the simulator through the twins, and on a Hopper GPU."""
    if not _simulator() and not _hopper_gpu():
        pytest.skip("the Hopper instructions run on compute capability 9.0 only")
    check_forward(d, causal, nq, nk, heads, grid, bn, window=window)


@pytest.mark.parametrize("causal, window, sched", [(True, None, -1), (False, (150, 0), 0)])
def test_forward_longest_first_rounds(causal, window, sched):
    """The longest-first deal with its odd rounds dealt back (``sched`` 0) or its even
    ones (−1): 3 query tiles of 3 heads (9 items) on 2 blocks, four whole rounds (two each
    way) and a partial one; one parity per rule (the deal is the same function whatever
    the rules, and the host test below takes both on every place); every item once
    (NaN-poisoned outputs), against the oracle."""
    if not _simulator() and not _hopper_gpu():
        pytest.skip("the Hopper instructions run on compute capability 9.0 only")
    check_forward(128, causal, 300, 300, (1, 3), 2, sched=sched, window=window)


def test_longest_first_rounds_where_the_model_says():
    """``longest_first_flip``: the parity of the rounds dealt back whose modelled busiest
    block (key tiles plus ``ITEM_COST`` an item) has less work; ``schedule`` passes it as
    −1 (even rounds) or 0, the pairs' places where causal rows take them, 0 for other
    rules. A window of 1024 keys at (1, 16, 16384, 128): the even rounds (busiest block
    3.4% over the mean with the odd ones, 1.2% with the even ones). The model's key tiles
    are counted here from the oracle's mask."""
    import numpy as np
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.kernels import wgmma_schedule as S
    from numba_flash.scores import parse, visible_mask
    for left, n, m, b in ((1024, 16384, 16384, 16), (None, 4096, 4096, 16), (None, 1024, 1024, 512),
                          (300, 2000, 2100, 7), (None, 1000, 700, 40)):
        seen = visible_mask(parse(True, window=None if left is None else (left, 0)), n, m)
        n_qt, n_kt = -(-n // 128), -(-m // 128)
        tiles = np.array([sum(seen[128 * qt:128 * qt + 128, 128 * kt:128 * kt + 128].any() for kt in range(n_kt))
                          for qt in range(n_qt - 1, -1, -1)], float) + S.ITEM_COST
        flip = S.longest_first_flip(left, 0, n, m, 128, b, 132, 128)
        busiest = [S._deal_loads(tiles, b, 132, f).max() for f in (0, 1)]
        assert busiest[flip] <= busiest[1 - flip], (left, n, b, busiest)
        assert S._deal_loads(tiles, b, 132, flip).sum() == tiles.sum() * b
    for n, grid in ((9, 2), (2048, 132), (264, 132), (100, 132), (1000, 7)):     # each a bijection
        for flip in (0, 1):
            items = [S.longest_first_item(i, grid, n, flip) for i in range(n)]      # the kernel's rule
            assert sorted(items) == list(range(n))
            assert items == S._longest_first_items(np.arange(n), grid, n, flip).tolist()   # the model's
    window = parse(window=(1024, 0))
    assert F.schedule(window, 128, 16384, 16384, 16, 132, 1 << 30) == -1
    loads = [S._deal_loads(np.minimum(np.arange(128, 0, -1), 9) + S.ITEM_COST, 16, 132, f) for f in (0, 1)]
    assert [round(x.max() / x.mean(), 3) for x in loads] == [1.034, 1.012]
    causal = parse(True)
    assert F.schedule(causal, 128, 4096, 4096, 64, 132, 1 << 30) == S.paired_places(32, 64, 132, 1 << 30) > 0
    assert F.schedule(parse(), 128, 4096, 4096, 64, 132, 1 << 30) == 0


@pytest.mark.parametrize("nq,nk,heads,grid,u0,flip", [
    (300, 300, (1, 2), 1, 2, 0),    # three query tiles: the pairs (2, 0) in whole rounds, the middle tiles
    (300, 300, (1, 2), 1, 1, 1),    # ... one pair left to the tail: its first tile, the middles, its second
    (256, 200, (1, 3), 2, 2, 1),    # three pairs on two blocks, the third in the tail; fewer keys than
                                    # queries: the first rows see none
    (512, 512, (1, 3), 3, 3, 0),    # the tail's pairs start inside a head (p from 1 there, from 0 after)
])
def test_forward_causal_pairs(nq, nk, heads, grid, u0, flip):
    """The pairs schedule of causal rows (``sched = 4 U0 + 2 flip + 1``, forced here whatever
    the model says): query tiles ``n_qt - 1 - p`` and ``p`` of one head to one block in
    whole rounds, then the tail (the other pairs' tiles and odd counts' middle tiles)
    heaviest first in rounds of either parity; every tile once (NaN-poisoned outputs)."""
    if not _simulator() and not _hopper_gpu():
        pytest.skip("the Hopper instructions run on compute capability 9.0 only")
    check_forward(128, True, nq, nk, heads, grid, sched=4 * u0 + 2 * flip + 1)


def _pairs_item(i, G, n_qt, B, sched):
    """``work_item``'s pairs branch, on the host (the tail through the kernel's own functions)."""
    from numba_flash.kernels import wgmma_schedule as S
    P, U0 = n_qt >> 1, sched >> 2
    if i < 2 * U0:
        r = i // G
        u = (r >> 1) * G + (i - r * G)
        p = u % P
        return (p if (r & 1) == 1 else n_qt - 1 - p), u // P
    return S.pairs_tail_tile(S.longest_first_item(i - 2 * U0, G, n_qt * B - 2 * U0, (sched >> 1) & 1), n_qt, B, U0)


def test_pairs_tail_deals_every_tile_once():
    """The pairs schedule with 0 to ``TAIL_ROUNDS`` whole rounds left to its tail, either
    parity: every (query tile, leading index) at exactly one place; the tail's tiles
    heaviest first (:func:`wgmma_schedule.pairs_tail_tile`)."""
    from numba_flash.kernels import wgmma_schedule as S
    for n_qt, B, G in ((8, 256, 132), (32, 64, 132), (33, 64, 132), (9, 100, 132), (3, 2, 1), (5, 3, 3), (2, 1000, 132)):
        P = n_qt // 2
        W = B * P // G
        want = sorted((q, b) for q in range(n_qt) for b in range(B))
        for u0 in {max(W - k, 1) * G for k in range(S.TAIL_ROUNDS + 1)}:
            for flip in (0, 1):
                sched = 4 * u0 + 2 * flip + 1
                assert sorted(_pairs_item(i, G, n_qt, B, sched) for i in range(n_qt * B)) == want, (n_qt, B, u0, flip)
            n_tail = n_qt * B - 2 * u0
            costs = [S.pairs_tail_tile(s, n_qt, B, u0)[0] for s in range(n_tail)]
            firsts = B * P - u0
            seconds = costs[n_tail - firsts:]
            assert costs[:firsts] == sorted(costs[:firsts], reverse=True) and seconds == sorted(seconds, reverse=True)
            assert min(costs[:firsts], default=n_qt) >= max(costs[firsts:], default=0)


def test_pairs_where_the_model_says():
    """``paired_places``: the pairs' ``4 U0 + 2 flip + 1`` (``U0`` whole rounds' pairs, at
    most ``TAIL_ROUNDS`` rounds fewer than there are; the tail's parity), or 0 (longest
    first) where every head's K and V fit in L2 or the pairs' modelled makespan is not
    within ``PAIRS_SLACK`` of the other's; only causal rows without a window, packed
    sequences or user functions take it (at 192 rows with ``PAIRS_WIDE``). (4, 16, 4096,
    128): the busiest block 3.1% over the mean with the tail of the whole rounds' leftovers
    in pairs, 0.5% with the model's choice."""
    import numpy as np
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.kernels import wgmma_schedule as S
    from numba_flash.scores import ScoreSpec
    kv = lambda b, n: b * n * 128 * 4      # noqa: E731 (bytes of K and V at d = 128, 16-bit)
    for n_qt, b, grid in ((32, 64, 132), (32, 256, 132), (128, 16, 132), (33, 64, 132), (2, 144, 132), (1, 16, 132)):
        got = S.paired_places(n_qt, b, grid, kv(b, 128 * n_qt))
        W = b * (n_qt // 2) // grid
        assert got == 0 or got & 1 and (got >> 2) in {max(W - k, 1) * grid for k in range(S.TAIL_ROUNDS + 1)}
    got = S.paired_places(32, 64, 132, kv(64, 4096))
    mean = (np.arange(1, 33) + S.ITEM_COST).sum() * 64 / 132
    assert round(S._pairs_loads(32, 64, 132, got >> 2, (got >> 1) & 1).max() / mean, 3) == 1.005
    assert S.paired_places(32, 256, 132, kv(256, 4096)) > 0     # (16, 16, 4096, 128): 31 rounds of equal pairs
    assert S.paired_places(32, 64, 132, kv(64, 4096)) > 0       # (4, 16, 4096, 128)
    assert S.paired_places(32, 16, 132, kv(16, 4096)) == 0      # (1, 16, 4096, 128): its K and V fit in L2
    assert S.paired_places(2, 144, 132, kv(144, 256)) == 0      # 144 pairs on 132 blocks: 12 twice as long
    assert F.paired(ScoreSpec(causal=True), 128) and F.paired(ScoreSpec(causal=True), 192, 64) == F.PAIRS_WIDE
    assert F.paired(ScoreSpec(causal=True), 128, 256)            # (up to PAIRS_HEAD_DIM: all head dims)
    assert not F.paired(ScoreSpec(window=True), 128) and not F.paired(ScoreSpec(causal=True, packed=True), 128)
    assert not F.paired(ScoreSpec(causal=True, window=True), 128) and not F.paired(ScoreSpec(), 128)


@pytest.mark.parametrize("d", [64, 128])
def test_block_rows_follow_the_rules(d):
    """The forward's tile shape per head dim and rules, as the registry hands it to the
    launches: 192 rows in four warpgroups at d = 64 without a window, ALiBi or packed rows
    (a softcap too where ``SOFTCAP_TILES`` says so), nor causal rows of calls with at most
    ``NARROW_CAUSAL_ROWS`` query rows, else 128 in three (a kernel of its own name where
    the call's rows chose it); the launch's threads and shared memory are the kernel's
    own."""
    from numba_flash import registry
    from numba_flash.kernels import forward_wgmma as F
    from numba_flash.scores import ScoreSpec
    for rules in (ScoreSpec(), ScoreSpec(causal=True), ScoreSpec(window=True), ScoreSpec(causal=True, softcap=True),
                  ScoreSpec(softcap=True), ScoreSpec(alibi=True), ScoreSpec(causal=True, packed=True)):
        spec = registry.specialisation("forward_wgmma", "bfloat16", d, rules, True)
        wide = d == 64 and not (rules.window or rules.softcap and d not in F.SOFTCAP_TILES or rules.alibi
                                or rules.packed)
        assert (spec.tiling.BM, spec.tiling.threads) == ((192, 512) if wide else (128, 384)), (d, rules)
        kern = spec.kernel()
        assert kern.threads == spec.tiling.threads
        assert kern.smem_bytes == spec.smem_bytes == F.smem_bytes(d, bm=spec.tiling.BM) <= F.SMEM_LIMIT
    for rules, rows in ((ScoreSpec(causal=True), F.NARROW_CAUSAL_ROWS), (ScoreSpec(causal=True), 1 + F.NARROW_CAUSAL_ROWS),
                        (ScoreSpec(), 100)):
        spec = registry.specialisation("forward_wgmma", "bfloat16", d, rules, True, rows=rows)
        narrow = d == 128 or (rules.causal and rows <= F.NARROW_CAUSAL_ROWS)
        assert spec.tiling.BM == (128 if narrow else 192), (d, rules, rows)
        assert spec.name.endswith("/rows128") == (d == 64 and narrow), spec.name
        assert spec.kernel().threads == spec.tiling.threads


@pytest.mark.parametrize("slow", [1, 2, 3])
def test_forward_with_a_slow_consumer(slow, monkeypatch):
    """The consumer warpgroups' turns (named barriers, a ring of three at d = 64) across a
    block's items with one consumer warpgroup slowed at every barrier
    (``_hopper_sim.SLOW_WARPGROUP``), so that the others run ahead: an order a GPU makes rare but allows must not deadlock or change the
    result. (Turns started afresh per item deadlocked here with the first consumer slow:
    the second, run ahead into the next item, completed a barrier the first had yet to
    sync on.)"""
    if not _simulator():
        pytest.skip("a slow warpgroup is the simulator's")
    from numba_flash import _hopper_sim
    monkeypatch.setattr(_hopper_sim, "SLOW_WARPGROUP", (slow, 0.05))
    monkeypatch.setattr(_hopper_sim, "_TIMEOUT_S", 60.0)
    check_forward(64, False, 200, 140, (1, 2), 1)     # d = 64: two Q buffers, nothing holds the second back


# --------------------------------------------------------------------------- the simulator's twins
def _simulator():
    import numba_flash
    return numba_flash.SIMULATOR


def test_every_hopper_name_has_a_simulator_twin():
    """In the simulator no public name of ops_hopper is left an intrinsic (or a factory of them)."""
    if not _simulator():
        pytest.skip("the twins replace the intrinsics in the simulator only")
    from numba_flash import _hopper_sim
    from numba_flash import ops_hopper as H
    left = [name for name, value in vars(H).items() if not name.startswith("_")
            and (getattr(value, "__module__", None) == H.__name__ or type(value).__name__ == "_Intrinsic")]
    assert not left, f"no simulator twin in _hopper_sim for {left}"
    assert all(getattr(H, name) is getattr(_hopper_sim, name) for name in _hopper_sim.__all__)


def test_tma_box_swizzle_and_zero_fill_in_simulator():
    """A TMA box lands as on the H200: row r's 16-byte chunk c at chunk c ^ (r % 8) of its
    128-byte row, elements outside the tensor zero; the mbarrier completes on its bytes."""
    if not _simulator():
        pytest.skip("a check of the simulator's twins")
    import numba
    import numpy as np
    from numba_flash import ops_hopper as H
    from numba_flash.launch import launch

    rows = 16

    @cuda.jit
    def kern(tmap, c0, c1, c2, c3, out):
        sm = cuda.shared.array(0, numba.uint8, alignment=1024)
        base = (H.shared_address(sm) + 1023) & ~1023
        bar = base + rows * 128
        H.mbarrier_init(bar, 1)
        H.fence_mbarrier_init()
        H.tensormap_acquire(H.global_address(tmap))
        H.mbarrier_arrive_expect_tx(bar, rows * 128)
        H.tma_load_4d(base, H.global_address(tmap), c0, c1, c2, c3, bar)
        while H.mbarrier_try_wait(bar, 0) == 0:
            pass
        for i in range(rows * 128):
            out[i] = sm[base - H.shared_address(sm) + i]

    src = np.arange(2 * 3 * 10 * 80, dtype=np.uint16).reshape(2, 3, 10, 80) + 1
    view = cuda.to_device(src)[:, :, :, 8:]             # d = 72: the box's last 8 columns fall outside
    tmap = H.tensor_map_4d(view, rows)
    out = cuda.to_device(np.zeros(rows * 128, np.uint8))
    launch(kern, 1, 1, 2 * 1024 + rows * 128, (tmap, 16, 5, 2, 1, out))
    box = np.zeros((rows, 64), np.uint16)               # (row, column) of the box at column 16, row 5
    box[:5, :56] = src[1, 2, 5:, 24:]
    got = out.copy_to_host().view(np.uint16).reshape(rows, 8, 8)   # (row, stored chunk, element)
    for r in range(rows):
        for c in range(8):
            np.testing.assert_array_equal(got[r, c ^ (r % 8)], box[r, 8 * c:8 * c + 8], err_msg=f"row {r} chunk {c}")


@pytest.mark.parametrize("arrivals,tx,missing", [(1, 0, "1 of 2 arrivals and 0 transaction"),
                                                   (2, 16, "0 of 2 arrivals and 16 transaction")])
def test_mbarrier_phase_needs_arrivals_and_bytes_in_simulator(monkeypatch, arrivals, tx, missing):
    """A phase completes only when every arrival and every expected byte is in (the phase
    before the first counts as complete); a wait on one that cannot complete fails with what
    is missing (here after 0.2 s)."""
    if not _simulator():
        pytest.skip("a check of the simulator's twins")
    import numba
    from numba_flash import _hopper_sim
    from numba_flash import ops_hopper as H
    from numba_flash.launch import launch

    monkeypatch.setattr(_hopper_sim, "_TIMEOUT_S", 0.2)

    @cuda.jit
    def kern():
        sm = cuda.shared.array(0, numba.uint8, alignment=1024)
        bar = (H.shared_address(sm) + 1023) & ~1023
        H.mbarrier_init(bar, 2)
        H.mbarrier_try_wait(bar, 1)                     # returns at once
        H.mbarrier_arrive(bar)
        if arrivals == 2:
            H.mbarrier_arrive_expect_tx(bar, tx)
        H.mbarrier_try_wait(bar, 0)

    with pytest.raises(RuntimeError, match=f"parity 0 never completed .{missing}"):
        launch(kern, 1, 1, 2048, ())


def test_named_barrier_producer_arrives_consumers_sync_in_simulator():
    """``named_arrive`` counts without waiting, ``named_barrier`` waits for the count: a
    producer warp's writes are visible to the consumer warp after its sync."""
    if not _simulator():
        pytest.skip("a check of the simulator's twins")
    import numba
    import numpy as np
    from numba_flash import ops_hopper as H
    from numba_flash.launch import launch

    @cuda.jit
    def kern(out):
        sm = cuda.shared.array(32, numba.int32)
        tid = cuda.threadIdx.x
        for rnd in range(3):
            if tid < 32:
                sm[tid] = 100 * rnd + tid
                H.named_arrive(3, 64)
                H.named_barrier(4, 64)          # the consumers have read this round
            else:
                H.named_barrier(3, 64)
                out[rnd, tid - 32] = sm[tid - 32]
                H.named_arrive(4, 64)

    out = np.zeros((3, 32), np.int32)
    launch(kern, 1, 64, 0, (out,))
    np.testing.assert_array_equal(out, 100 * np.arange(3)[:, None] + np.arange(32))


def test_wgmma_layouts_in_simulator():
    """The layout kernel (the H200's TMA and wgmma layouts, above) runs on the simulator's twins."""
    if not _simulator():
        pytest.skip("the GPU runs test_wgmma_layouts_on_gpu")
    check_layouts()


@pytest.mark.parametrize("d,causal,nq,nk", [(64, True, 100, 150), (128, False, 130, 300)])
def test_forward_in_simulator(d, causal, nq, nk):
    """The Hopper forward on the twins: one or two blocks, ragged tiles, a ring that wraps."""
    if not _simulator():
        pytest.skip("the GPU runs test_forward_draft_on_gpu")
    check_forward(d, causal, nq, nk, (1, 1))


def test_packed_output_views_check_the_alignment():
    """The Hopper forward's output view (``_arrays.packed_view``): quads of 16-bit values
    whose rows start on 8 bytes; a view whose start or row stride is not a multiple of 8
    bytes is refused (None: the next family takes the call), never written out of line."""
    import numpy as np
    from numba_flash import _arrays
    wide = cuda.to_device(np.zeros((2, 3, 5, 8), np.uint16))
    assert _arrays.packed_view(cuda.to_device(np.zeros((2, 3, 5, 4), np.uint16))) is not None
    assert _arrays.packed_view(wide[:, :, :, 4:]) is not None          # 8 bytes in, rows 16 apart
    assert _arrays.packed_view(wide[:, :, :, 2:6]) is None             # 4 bytes in
    assert _arrays.packed_view(cuda.to_device(np.zeros((2, 3, 5, 6), np.uint16))[:, :, :, :4]) is None  # rows 12 apart


if __name__ == "__main__":
    main()
