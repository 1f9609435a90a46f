"""How long a new user waits: a fresh process's first attention call, with an empty kernel
cache and then with the cache the first process left (a GPU machine)::

    python tools/first_call.py                                   # bf16 (4,16,4096,128), then fp16 causal
    python tools/first_call.py --call "bfloat16,1,8,512,128,1" --rounds 3 --json first.json

Each round starts two processes per call on a new, empty kernel cache
(``NUMBA_FLASH_CACHE_DIR``): the first compiles the call's kernels and stores them, the
second loads them. Each process imports PyTorch and makes its CUDA context (a user's
model would have done both), then times ``import numba_flash``, the first call
(``numba_flash.attention`` on PyTorch CUDA tensors, synchronised) and a second call, and
prints one JSON line. Before the rounds a warm-up process imports PyTorch and numba_flash
once, so that the files are in the page cache as they are for a user's second run (a
machine just started read 20.99 s once, against 7.2 s after: docs/performance.md item 73).
Issue targets: the first call of the first process <= 5 s, of the second process <= 1 s
after the import.

Without a GPU, ``--offline`` times the part of a first call that does not need one: in a
fresh process per kernel and round, ``python -m numba_flash.ptx --cc 9.0 --only KERNEL``
(the import, Numba's front end and NVVM for sm_90a, as a first call on an H200 compiles
it; default: the fp16 causal and bf16 full-rows d = 128 Hopper forwards). On a 2-core
x86-64 machine it read 7.5 s for the fp16 causal kernel when the H200's first call took
7.2 s (docs/performance.md items 73 and 83).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_CALLS = "bfloat16,4,16,4096,128,0;float16,1,8,512,128,1"
OFFLINE_KERNELS = "forward_wgmma/float16/d128/causal,forward_wgmma/bfloat16/d128/full"

WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
import numba_flash
t2 = time.perf_counter()
dtype, b, h, n, d, causal = sys.argv[1].split(",")
q, k, v = (torch.randn(int(b), int(h), int(n), int(d), device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
torch.cuda.synchronize()
t3 = time.perf_counter()
numba_flash.attention(q, k, v, causal=causal == "1")
torch.cuda.synchronize()
t4 = time.perf_counter()
numba_flash.attention(q, k, v, causal=causal == "1")
torch.cuda.synchronize()
t5 = time.perf_counter()
print(json.dumps(dict(torch_and_context_s=t1 - t0, import_s=t2 - t1, first_call_s=t4 - t3, second_call_s=t5 - t4)))
"""


def parse_calls(text):
    """``"dtype,B,H,N,d,causal;..."`` -> list of (dtype, B, H, N, d, causal) tuples."""
    calls = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [f.strip() for f in part.split(",")]
        if len(fields) != 6 or fields[0] not in ("float16", "bfloat16", "float32", "float64") \
                or not all(f.isdigit() and int(f) > 0 for f in fields[1:5]) or fields[5] not in ("0", "1"):
            raise ValueError(f"a call is dtype,B,H,N,d,causal (e.g. bfloat16,4,16,4096,128,0), got {part!r}")
        calls.append((fields[0], *map(int, fields[1:5]), int(fields[5])))
    return calls


def run_process(call, cache_dir, env=None, timeout=600):
    """One fresh process's timings of ``call`` (a dict), its kernel cache in ``cache_dir``."""
    env = dict(os.environ if env is None else env, NUMBA_FLASH_CACHE_DIR=cache_dir)
    proc = subprocess.run([sys.executable, "-c", WORKER, ",".join(map(str, call))], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the process for {call} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def offline(kernels, rounds):
    """``[(kernel, round, seconds)]``: each kernel's compile to sm_90a PTX in a fresh process."""
    import time
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    found = []
    for r in range(rounds):
        for kernel in kernels:
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "numba_flash.ptx", "--cc", "9.0", "--only", kernel], env=env,
                                  capture_output=True, text=True, timeout=600)
            seconds = time.perf_counter() - t
            if proc.returncode != 0 or kernel not in proc.stdout:
                raise RuntimeError(f"compiling {kernel} failed (or matched no kernel):\n{proc.stderr[-3000:]}")
            found.append((kernel, r, seconds))
            print(f"{kernel:>40} round {r}: {seconds:.2f} s (process start, import, front end, NVVM)", flush=True)
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--call", default=DEFAULT_CALLS, help=f'calls "dtype,B,H,N,d,causal;..." (default {DEFAULT_CALLS})')
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--offline", nargs="?", const=OFFLINE_KERNELS, default=None, metavar="KERNELS",
                   help=f"no GPU: time the compile of these kernels (comma-separated names, default {OFFLINE_KERNELS})")
    a = p.parse_args(argv)
    if a.offline:
        found = offline([k for k in a.offline.split(",") if k], a.rounds)
        if a.json:
            with open(a.json, "w") as f:
                json.dump([dict(kernel=k, round=r, seconds=s) for k, r, s in found], f, indent=1)
        return 0
    calls = parse_calls(a.call)
    records = []
    with tempfile.TemporaryDirectory() as warm:
        run_process(calls[0], warm)                     # the page cache, as for a user's second run
    for r in range(a.rounds):
        for call in calls:
            with tempfile.TemporaryDirectory() as cache:
                for process in ("first", "second"):
                    rec = dict(run_process(call, cache), call=call, round=r, process=process)
                    records.append(rec)
                    print(f"{','.join(map(str, call)):>28} round {r} {process:>6} process: import "
                          f"{rec['import_s']:.2f} s, first call {rec['first_call_s']:.2f} s, "
                          f"second call {rec['second_call_s'] * 1e3:.1f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
