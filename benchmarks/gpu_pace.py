"""GPU time per call, at the GPU's pace: calls queued behind a GPU sleep.

A call whose kernels run for a few microseconds is launched more slowly than it runs, so
calls issued back to back measure the host's pace of launching (docs/performance.md item
80: batch-1 decoding read 3.6x slower than cuDNN that way, 1.5x at the GPU's pace). Here
each repeat's calls are queued behind ``torch.cuda._sleep`` on PyTorch's current stream,
lasting half as long again as the host took to queue them, so that they run back to back
with nothing between them but what the GPU itself does. Needs PyTorch with a GPU, and
calls that launch on PyTorch's current stream (PyTorch's own, and numba_flash's with
PyTorch tensors). Imports nothing else: ``tools/ab.py`` uses it with any tree's
numba_flash.
"""
import time


def gpu_pace_ms(fn, torch, reps=7, min_calls=20, min_s=0.01, max_calls=500):
    """Milliseconds per call of ``fn`` (median of ``reps`` repeats) at the GPU's pace: each
    repeat queues ``n`` calls behind a sleep on the current stream; ``n``: at least
    ``min_calls`` and ``min_s`` seconds of the host's queueing, at most ``max_calls`` (the
    driver's launch queue stays short of full)."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    n, t0 = 0, time.perf_counter()
    while n < max_calls and (n < min_calls or time.perf_counter() - t0 < min_s):
        fn()
        n += 1
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles_per_s = 10**7 / (start.elapsed_time(end) / 1e3)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(int(cycles_per_s * (1.5 * host_s + 1e-3)))
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host_s = max(host_s, time.perf_counter() - t0)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return sorted(times)[reps // 2]
