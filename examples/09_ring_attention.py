"""Ring attention: one sequence spread over several processes (GPUs), exact, with autograd.

    torchrun --nproc_per_node=2 examples/09_ring_attention.py     # one process per GPU (NCCL)
    python examples/09_ring_attention.py                           # spawns 2 CPU processes (gloo)

NCCL needs a GPU of its own for each rank: with fewer GPUs than a host's ranks they talk
through gloo with CPU tensors (numba_flash still runs its kernels on the GPU there).

Each rank holds a zigzag shard of q, k, v (chunks r and 2P-1-r of 2P, so that a causal
mask gives every rank the same work); numba_flash.distributed.ring_attention passes the K/V
shards around the ring, merges the partial results exactly through their log-sum-exp and
sends dK/dV back to their owners in the backward. Checked here against one process
computing the whole sequence.
"""
import os

import torch
import torch.distributed as dist


def main(rank, world):
    import numba_flash
    from numba_flash.distributed import ring_attention, zigzag_shard, zigzag_unshard
    local_rank = int(os.environ.get("LOCAL_RANK", rank))         # (torchrun sets these; spawned: one host)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available() and not numba_flash.SIMULATOR and torch.cuda.device_count() >= local_world
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    B, H, N, D = (1, 8, 8192, 128) if cuda else (1, 2, 8 * world, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)                  # every rank draws the same full sequence
    q, k, v, dout = (torch.randn(B, H, N, D, generator=g).to(device, dtype) for _ in range(4))
    shards = [zigzag_shard(x, rank, world).clone().requires_grad_(x is not dout) for x in (q, k, v, dout)]
    out = ring_attention(*shards[:3], causal=True)
    out.backward(shards[3])
    pieces = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(pieces, out.detach().contiguous())
    if rank == 0:
        whole = numba_flash.attention(q, k, v, causal=True)        # one process, the whole sequence
        err = (zigzag_unshard(pieces).float() - whole.float()).abs().max().item()
        print(f"{world} ranks, N = {N}: ring output vs one process: max difference {err:.1e}")
        assert err < (3e-2 if dtype == torch.bfloat16 else 1e-5)
    print(f"rank {rank}: dq {tuple(shards[0].grad.shape)}, dk {tuple(shards[1].grad.shape)} computed")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:                                   # under torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        import socket
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        mp.spawn(main, args=(2,), nprocs=2)
