"""Two (or more) processes on one machine: ring attention against the float64 oracle on the
full sequence. Run by tests/test_distributed.py as ``python tests/ring_worker.py WORLD PORT
[nccl]``: gloo with CPU tensors (the simulator computes each rank's attention), or NCCL with
one GPU per rank (NVLink multicast off); prints one JSON line per (rank, case)."""
import json
import os
import sys

import torch
import torch.distributed as dist

CASES = [  # (causal, Hq, Hkv, dtype)
    (True, 2, 1, "float32"),
    (False, 2, 2, "bfloat16"),
]


def worker(rank, world, port, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    import numba_flash  # noqa: F401  (decides the simulator before numba loads)
    from numba_flash import distributed as D, reference
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    for causal, hq, hkv, dtype in CASES:
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(hq * 10 + hkv + causal)
        n, d = (4 * world, 8) if backend == "gloo" else (256 * world, 64)
        q, dout = (torch.randn(1, hq, n, d, generator=g) for _ in range(2))
        k, v = (torch.randn(1, hkv, n, d, generator=g) for _ in range(2))
        q, k, v, dout = (x.to(dt) for x in (q, k, v, dout))
        shard = (lambda x: D.zigzag_shard(x, rank, world)) if causal else (lambda x: x.chunk(world, -2)[rank])
        qs, ks, vs = (shard(x).to(device).clone().requires_grad_(True) for x in (q, k, v))
        out, lse = D.ring_attention(qs, ks, vs, causal=causal, return_lse=True)
        again = D.ring_attention(qs.detach(), ks.detach(), vs.detach(), causal=causal)
        out.backward(shard(dout).to(device))
        out, lse, again = out.cpu(), lse.cpu(), again.cpu()
        grads = [x.grad.cpu() for x in (qs, ks, vs)]
        full = [x.double().numpy() for x in (q, k, v)]
        ro, rl = reference.attention_fwd(*full, causal=causal)
        rg = reference.attention_bwd(dout.double().numpy(), *full, causal=causal)
        err = lambda got, want: float((got.detach().double() - shard(torch.from_numpy(want))).abs().max())  # noqa: E731
        gathered = [torch.empty_like(out).to(device) for _ in range(world)]
        dist.all_gather(gathered, out.detach().contiguous().to(device))
        gathered = [x.cpu() for x in gathered]
        whole = D.zigzag_unshard(gathered) if causal else torch.cat(gathered, -2)
        row = json.dumps({"rank": rank, "case": [causal, hq, hkv, dtype], "out": err(out, ro),
                          "lse": float((lse.double() - shard(torch.from_numpy(rl)[..., None])[..., 0]).abs().max()),
                          "dq": err(grads[0], rg[0]), "dk": err(grads[1], rg[1]), "dv": err(grads[2], rg[2]),
                          "repeat_bitwise": bool(torch.equal(again, out.detach())),
                          "unshard": float((whole.double() - torch.from_numpy(ro)).abs().max())})
        sys.stdout.flush()
        os.write(1, (row + "\n").encode())   # one write: the ranks share the pipe, lines must not interleave
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "gloo"),
             nprocs=int(sys.argv[1]))
