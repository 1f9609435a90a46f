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

if __name__ != "__main__":
    import pytest
    from conftest import HANG_GUARD_S, project_env

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


def main():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
    from numba_flash import ptx
    kern, sig = sample_kernel()
    cc = (9, 0, "a")
    text = ptx.compile_ptx(kern, sig, [cc], launch_bounds=(256, 1))[cc]
    report = {"target": re.findall(r"^\.target\s+(\S+)", text, re.M),
              **{k: text.count(k) for k in ("wgmma.mma_async", "cp.async.bulk.tensor.3d", "cp.async.bulk.tensor.4d",
                                            "mbarrier.try_wait",
                                            "setmaxnreg", "bar.sync", ".local")}}
    tool = ptx.find_ptxas()
    if tool:
        info = ptx.assemble(text, cc, tool)
        report["assembled"] = bool(info)
        report.update({k: info[k] for k in ("registers", "spill_stores") if k in info})
    print(json.dumps(report))


def test_hopper_intrinsics_compile_for_sm_90a():
    proc = subprocess.run([sys.executable, __file__], env=project_env(NUMBA_ENABLE_CUDASIM="0"),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["target"] == ["sm_90a"]
    assert report["wgmma.mma_async"] == 3 and report["cp.async.bulk.tensor.3d"] == 1
    assert report["cp.async.bulk.tensor.4d"] == 1
    assert report["mbarrier.try_wait"] >= 1 and report["setmaxnreg"] == 2 and report["bar.sync"] >= 1
    assert report[".local"] == 0, "the accumulator tuple must stay in registers"
    if "assembled" not in report:
        pytest.skip("no ptxas: PTX checked, not assembled")
    assert report["assembled"] and report.get("spill_stores", 0) == 0, report


if __name__ == "__main__":
    main()
