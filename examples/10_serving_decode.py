"""Serving: a prompt and decoding steps against a paged KV cache, the metadata on the device.

    python examples/10_serving_decode.py

A batch of sequences shares one pool of cache pages (``(num_pages, page_size, Hkv, d)``,
handed out in any order through a block table). Each call of ``attention_with_kvcache``
writes the new keys and values into the cache at ``cache_seqlens`` and attends to
everything the sequence holds; the caller advances ``cache_seqlens``. The prefill writes
the prompts (causal: prompt token i sees tokens 0..i), then each decoding step appends one
token. With ``check_metadata=False`` the lengths and the block table stay on the device
and are read there (nothing waits for the GPU, as in a serving loop; a length or page out
of range skips its sequence instead of raising). Every step is checked against the
float64 oracle over the rows the sequence holds.
"""
import numpy as np

import numba_flash                  # first: it decides between the GPU and the simulator
from numba import cuda
from numba_flash import reference

if numba_flash.SIMULATOR:
    B, HQ, HKV, D, PAGE, PAGES_PER_SEQ, PROMPT, STEPS = 2, 4, 2, 16, 4, 4, 5, 3
else:
    B, HQ, HKV, D, PAGE, PAGES_PER_SEQ, PROMPT, STEPS = 8, 32, 8, 128, 16, 64, 300, 20
rng = np.random.default_rng()
num_pages = B * PAGES_PER_SEQ + 3                       # a few pages no sequence uses
k_pages = cuda.to_device(np.zeros((num_pages, PAGE, HKV, D), np.float32))
v_pages = cuda.to_device(np.zeros((num_pages, PAGE, HKV, D), np.float32))
table = rng.permutation(num_pages)[:B * PAGES_PER_SEQ].reshape(B, PAGES_PER_SEQ).astype(np.int32)
block_table = cuda.to_device(table)                    # sequence b's row j: page table[b, j // PAGE]
history_k = np.zeros((B, 0, HKV, D), np.float32)       # what each sequence holds, for the oracle
history_v = np.zeros((B, 0, HKV, D), np.float32)


def step(n_new, held):
    """Append ``n_new`` tokens to every sequence (which holds ``held`` rows) and attend."""
    global history_k, history_v
    q = rng.standard_normal((B, n_new, HQ, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, n_new, HKV, D)).astype(np.float32) for _ in range(2))
    lens = cuda.to_device(np.full(B, held, np.int32))  # (a server keeps it on the device and adds to it)
    out = numba_flash.attention_with_kvcache(cuda.to_device(q), k_pages, v_pages, lens, k_new=cuda.to_device(k_new),
                                             v_new=cuda.to_device(v_new), block_table=block_table, causal=True,
                                             check_metadata=False).copy_to_host()
    history_k = np.concatenate([history_k, k_new], axis=1)
    history_v = np.concatenate([history_v, v_new], axis=1)
    group = HQ // HKV
    for b in range(B):
        heads = lambda x: np.repeat(np.swapaxes(x[b], 0, 1), group, axis=0).astype(np.float64)  # noqa: E731
        want = reference.attention(np.swapaxes(q[b], 0, 1).astype(np.float64), heads(history_k),
                                   heads(history_v), causal=True)
        err = np.abs(np.swapaxes(out[b], 0, 1) - want).max()
        assert err < 1e-4, (b, err)
    return err


err = step(PROMPT, 0)
print(f"prefill: {B} prompts of {PROMPT} tokens written into {num_pages} shuffled pages of {PAGE} rows, "
      f"max error {err:.1e}")
for s in range(STEPS):
    err = step(1, PROMPT + s)
print(f"{STEPS} decoding steps, {HQ} query heads on {HKV} K/V heads: every step matches the oracle "
      f"(last max error {err:.1e}); each sequence now holds {PROMPT + STEPS} of its {PAGES_PER_SEQ * PAGE} rows")

# The cache as the pages spell it out: the rows each sequence holds are what it was given.
kh = k_pages.copy_to_host()
rows = np.arange(PROMPT + STEPS)
for b in range(B):
    assert (kh[table[b, rows // PAGE], rows % PAGE] == history_k[b]).all()
print("the paged cache holds every appended row where the block table says")
