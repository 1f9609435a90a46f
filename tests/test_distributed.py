"""Ring attention (numba_flash.distributed): the ring's logic on CPU tensors under gloo,
two processes on one machine (the simulator computes each rank's attention), against the
float64 oracle on the whole sequence; zigzag sharding alone."""
import json
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from conftest import ROOT, process_failure, project_env  # noqa: E402

TOL = {"float32": 2e-5, "bfloat16": 6e-2}   # out/lse/gradients of N(0, 1) data, d = 8: a few ulps each


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zigzag_shard_and_unshard():
    from numba_flash.distributed import zigzag_shard, zigzag_unshard
    x = torch.arange(24).reshape(1, 1, 12, 2)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0][0, 0, :, 0].tolist() == [0, 2, 20, 22]           # chunks 0 and 5 of 6
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="does not divide"):
        zigzag_shard(torch.zeros(1, 1, 10, 2), 0, 3)


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_ring_matches_the_oracle_on_two_ranks(backend):
    """Causal (zigzag) with grouped heads in float32, non-causal in bfloat16: out, lse, dq, dk, dv
    of each rank's shard, the all-gathered output unsharded, and a repeat bitwise equal; two
    CPU processes under gloo (the simulator), and two GPUs under NCCL where a machine has them."""
    if backend == "gloo" and not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo")
    if backend == "nccl" and not _two_gpus():
        pytest.skip("two CUDA GPUs and NCCL")
    env = project_env(NUMBA_ENABLE_CUDASIM="1") if backend == "gloo" else project_env(NCCL_NVLS_ENABLE="0")
    proc = subprocess.run([sys.executable, "tests/ring_worker.py", "2", str(_free_port()), backend], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, process_failure(proc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 2, proc.stdout
    for row in rows:
        tol = TOL[row["case"][3]]
        for name in ("out", "lse", "dq", "dk", "dv", "unshard"):
            assert np.isfinite(row[name]) and row[name] <= tol, (row, name)
        assert row["repeat_bitwise"], row
