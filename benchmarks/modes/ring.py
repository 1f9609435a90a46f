"""``bench.py ring``: context-parallel ring attention (numba_flash.distributed) on every GPU of
the machine, one process per GPU (NCCL), against one GPU computing a shard's length.

Per row (causal or not): forward and forward + backward of ``ring_attention`` over a
sequence of ``N`` keys cut into ``P`` shards (zigzag under a causal mask), timed on every
rank with CUDA events (median of the repeats, ranks synchronised by a barrier before each);
TFLOP/s per GPU = the whole problem's FLOPs / P / time. The single-GPU reference is
``numba_flash.attention`` (and its backward) at ``N / P`` on one GPU, the issue's yardstick:
scaling efficiency = ring TFLOP/s per GPU / single-GPU TFLOP/s. Communication: the time of
the ``P − 1`` K/V exchanges alone, and the compute alone (the ring's attention calls on local
data, no exchange); hidden = (compute + exchanges − ring) / exchanges, clamped to [0, 1].

``--tiny``: two CPU processes under gloo in the simulator (a smoke test: meaningless times).
NCCL's NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).
"""
import json
import os
import socket
import tempfile
import time

import numpy as np

FWD, BWD = 1.0, 2.5          # FLOP factors: forward 4·d per visible pair, backward 2.5x that


def ring_options(p):
    p.add_argument("--ring-n", type=int, default=None, help="total sequence length (default 262144; --tiny 32)")
    p.add_argument("--ring-heads", type=int, default=16, help="heads (default 16)")
    p.add_argument("--ring-d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--ring-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype (default bfloat16)")
    p.add_argument("--ring-world", type=int, default=None, help="processes (default: every GPU; --tiny 2)")


def _time(fn, repeats, cuda, barrier):
    """Median seconds of ``fn`` over ``repeats`` runs, each after a barrier."""
    import torch
    times = []
    for _ in range(repeats):
        barrier()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def _worker(rank, world, port, cfg, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    import torch
    import torch.distributed as dist
    import numba_flash
    from numba_flash import distributed as D
    cuda = not numba_flash.SIMULATOR and torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dt = getattr(torch, cfg["dtype"])
    H, N, d, reps, warm = cfg["heads"], cfg["n"], cfg["d"], cfg["repeats"], cfg["warmup"]
    n = N // world
    rows = []
    for causal in (True, False):
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, H, n, d, generator=g).to(device, dt) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        pairs = N * (N + 1) / 2 if causal else float(N) * N
        flops = 4.0 * d * H * pairs

        def fwd():
            with torch.no_grad():
                D.ring_attention(q, k, v, causal=causal)

        def fwd_bwd():
            D.ring_attention(q, k, v, causal=causal).backward(dout)

        def exchanges():
            kv = torch.stack([k.detach(), v.detach()]).contiguous()
            for _ in range(world - 1):
                reqs, kv = D._step_exchange(kv, None, rank, world)
                for r in reqs:
                    r.wait()

        def compute_only():
            with torch.no_grad():
                for step in range(world):
                    src = (rank - step) % world
                    for a, b, diag in D._pairs(rank, src, world, causal):
                        numba_flash.attention_fwd(D._chunk(q, a), D._chunk(k, b), D._chunk(v, b), causal=diag)
        for fn in (fwd, fwd_bwd, exchanges, compute_only):
            for _ in range(warm):
                fn()
        barrier = dist.barrier
        t = {name: _time(fn, reps, cuda, barrier) for name, fn in
             (("fwd", fwd), ("fwd_bwd", fwd_bwd), ("exchanges", exchanges), ("compute", compute_only))}
        single = {}
        if rank == 0:                            # one GPU at a shard's length
            qs, ks, vs, ds = (torch.randn(1, H, n, d, generator=g).to(device, dt) for _ in range(4))
            s_pairs = n * (n + 1) / 2 if causal else float(n) * n
            s_flops = 4.0 * d * H * s_pairs
            out, lse = numba_flash.attention_fwd(qs, ks, vs, causal=causal)
            sf = _time(lambda: numba_flash.attention_fwd(qs, ks, vs, causal=causal), reps, cuda, lambda: None)
            sb = _time(lambda: numba_flash.attention_bwd(ds, qs, ks, vs, out, lse, causal=causal), reps, cuda,
                       lambda: None)
            single = {"fwd_tflops": s_flops / sf / 1e12, "fwd_bwd_tflops": (1 + BWD) * s_flops / (sf + sb) / 1e12}
        hidden = (t["compute"] + t["exchanges"] - t["fwd"]) / t["exchanges"] if t["exchanges"] > 0 else None
        rows.append({"causal": causal, "times_s": t, "flops": flops,
                     "fwd_tflops_per_gpu": flops / world / t["fwd"] / 1e12,
                     "fwd_bwd_tflops_per_gpu": (1 + BWD) * flops / world / t["fwd_bwd"] / 1e12,
                     "single": single, "hidden": None if hidden is None else min(1.0, max(0.0, hidden))})
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run_ring(args):
    import torch
    import torch.multiprocessing as mp
    from numba_flash import SIMULATOR
    tiny = args.tiny
    world = args.ring_world or (2 if tiny or SIMULATOR else torch.cuda.device_count())
    n = args.ring_n or (32 if tiny else 262144)
    cfg = {"heads": 2 if tiny else args.ring_heads, "d": 16 if tiny else args.ring_d, "n": n,
           "dtype": "float32" if tiny and SIMULATOR else args.ring_dtype,
           "repeats": args.repeats, "warmup": args.warmup}
    if n % (2 * world):
        print(f"--ring-n {n} must divide into 2 x {world} zigzag chunks", flush=True)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ring.json")
        mp.spawn(_worker, args=(world, port, cfg, out), nprocs=world)
        with open(out) as f:
            per_rank = json.load(f)
    rows = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        worst = max(ranks, key=lambda r: r["times_s"]["fwd_bwd"])      # the slowest rank sets the pace
        single = row["single"]
        rec = {"causal": row["causal"], "world": world, "N": n, **{k: cfg[k] for k in ("heads", "d", "dtype")},
               "fwd_ms": 1e3 * max(r["times_s"]["fwd"] for r in ranks),
               "fwd_bwd_ms": 1e3 * worst["times_s"]["fwd_bwd"],
               "fwd_tflops_per_gpu": min(r["fwd_tflops_per_gpu"] for r in ranks),
               "fwd_bwd_tflops_per_gpu": min(r["fwd_bwd_tflops_per_gpu"] for r in ranks),
               "single": single, "exchanges_ms": 1e3 * max(r["times_s"]["exchanges"] for r in ranks),
               "hidden": min((r["hidden"] for r in ranks if r["hidden"] is not None), default=None)}
        if single:
            rec["efficiency_fwd"] = rec["fwd_tflops_per_gpu"] / single["fwd_tflops"]
            rec["efficiency_fwd_bwd"] = rec["fwd_bwd_tflops_per_gpu"] / single["fwd_bwd_tflops"]
        rows.append(rec)
    doc = {"mode": "ring", "date": time.strftime("%Y-%m-%d"), "tiny": tiny, "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_ring_markdown(doc))
    print(f"{'causal':>6} {'P':>2} {'N':>7} {'fwd ms':>8} {'TF/s/GPU':>9} {'eff':>5} {'fwd+bwd ms':>11} "
          f"{'TF/s/GPU':>9} {'eff':>5} {'exch ms':>8} {'hidden':>6}")
    for r in rows:
        f = lambda x, spec: "—" if x is None else format(x, spec)  # noqa: E731
        print(f"{str(r['causal']):>6} {r['world']:>2} {r['N']:>7} {r['fwd_ms']:>8.3f} {r['fwd_tflops_per_gpu']:>9.1f} "
              f"{f(r.get('efficiency_fwd'), '.2f'):>5} {r['fwd_bwd_ms']:>11.3f} {r['fwd_bwd_tflops_per_gpu']:>9.1f} "
              f"{f(r.get('efficiency_fwd_bwd'), '.2f'):>5} {r['exchanges_ms']:>8.3f} {f(r['hidden'], '.2f'):>6}")
    print("TF/s/GPU: the whole problem's FLOPs / P / the slowest rank's time; eff: that / one GPU's TF/s at N / P "
          "(numba_flash.attention); hidden: share of the K/V exchanges' time hidden behind compute.")
    return 0


def render_ring_markdown(doc):
    lines = [f"**ring** · {doc['date']}", "",
             "| causal | P | N | fwd ms | fwd TFLOP/s per GPU | efficiency | fwd+bwd ms | fwd+bwd TFLOP/s per GPU "
             "| efficiency | exchanges ms | hidden |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        f = lambda x, spec: "—" if x is None else format(x, spec)  # noqa: E731
        lines.append(f"| {r['causal']} | {r['world']} | {r['N']} | {r['fwd_ms']:.3f} | {r['fwd_tflops_per_gpu']:.1f} | "
                     f"{f(r.get('efficiency_fwd'), '.2f')} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops_per_gpu']:.1f} | "
                     f"{f(r.get('efficiency_fwd_bwd'), '.2f')} | {r['exchanges_ms']:.3f} | {f(r['hidden'], '.2f')} |")
    return "\n".join(lines) + "\n"
