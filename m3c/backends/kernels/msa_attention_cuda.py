"""MSA sparse-attention decode on the tensor cores from CUDA C++ (``cuda/msa_attention_mma.cu``) — NOT YET RUN ON A
GPU: off by default (:data:`m3c.backends.kernels.msa_attention.ATTN_CUDA`) until its GPU tests and benchmark pass.

Why: the Triton decode kernel takes ~14 µs per (row, KV group) at every context on the H200 (28 µs for 4 rows,
78 µs for 32 × 4), latency-bound on its per-step NVFP4 decode and dot layout changes; at 512K tokens × 8 requests
that and the top-k keep the MSA decode at 1.88× its byte floor (benchmarks/RESULTS.md, session 14).

Design: one warp per (query row, KV group, split); the group's HG <= 16 query heads are one m16 MMA tile (rows past
HG are zeros, never stored). Per 64-key step of a selected block:
- S = Q K^T with keys as the MMA's N: lane (g, c) loads the 16-byte quarter c of key 8j + g (its 32 K values over
  the 8 MMA steps, the indexer kernel's layout) and decodes it by byte permutes into f16 B fragments (exact);
  Q is staged once as f16 × 2^-e per head (bf16 queries are exact in f16), so scores are q.k × 2^e × scale in the
  log2 domain.
- Online softmax in registers (keys past the row's position are -inf), P rounded to f16 straight from the S
  fragments into the A fragments of P V (the C layout of two n8 tiles is the A layout of one k16 step).
- O += P V with both the key order and the output-dim order free: lane (g, c) owns output dims 16g .. 16g + 15
  (tile jd's column g is dim 16g + jd), i.e. one scale group and 8 contiguous code bytes of each of its 4 keys a
  k16 step; two keys' nibbles are interleaved by byte permutes so one decode yields (key A, key B) f16 pairs, times
  the (scale A, scale B) pair. No shared memory. Keys past the position read as zeros (the cache may hold NaN).
Splits write (O, m, l) and the last to arrive merges them exactly in a fixed order (as the Triton kernel does).
V for a whole 64-key step is loaded with K (one DRAM round trip a step). Registers: 220-237 (offline sm_90a, no
spills). A row past ``query_start_loc[R]`` (a padded batch) outputs zeros. Numerics: P in f16 (the Triton kernel rounds P to bf16), ex2.approx.
"""

from __future__ import annotations

import functools

import torch

from m3c.backends.cuda_aot import CudaKernelSpec
from m3c.backends.kernels.host import cuda_kernel_device, persistent
from m3c.backends.triton_aot import Runner

SOURCE = "msa_attention_mma.cu"
HEAD_DIM = 128


def supported(num_heads: int, num_kv_heads: int, d: int, block_size: int, top_k: int, q_dtype: str) -> str | None:
    """None if the CUDA decode kernel takes this layout, else the reason."""
    if d != HEAD_DIM:
        return f"head dim {d}: the CUDA kernel takes {HEAD_DIM}"
    if block_size < 64 or block_size % 64:
        return f"block size {block_size}: the CUDA kernel takes multiples of 64"
    if num_kv_heads < 1 or num_heads % num_kv_heads or not 1 <= num_heads // num_kv_heads <= 16:
        return f"{num_heads} / {num_kv_heads} heads: the CUDA kernel takes 1..16 query heads a KV group"
    if not 1 <= top_k <= 32:
        return f"top_k {top_k}: the CUDA kernel takes 1..32"
    if q_dtype != "bf16":
        return f"q is {q_dtype}: the CUDA kernel takes bf16"
    return None


def call_supported(q: torch.Tensor, num_kv_heads: int, block_size: int, top_k: int) -> str | None:
    """:func:`supported` for one call, plus the device (CUDA sm_89+, not the Triton interpreter)."""
    why = cuda_kernel_device(q)
    if why:
        return why
    q_dtype = "bf16" if q.dtype == torch.bfloat16 else str(q.dtype)
    return supported(q.shape[1], num_kv_heads, q.shape[2], block_size, top_k, q_dtype)


@functools.cache
def decode_spec(num_heads: int, num_kv_heads: int, block_size: int, top_k: int, split: int) -> CudaKernelSpec:
    """The kernel's spec for a layout and split (one warp a program)."""
    ptrs = ["q", "kd", "ks", "vd", "vs", "sel", "pos", "qsl", "seq", "bt", "out", "ws", "ml", "cnt"]
    types = (*((a, "*u8") for a in ptrs), ("n_req", "i32"), ("bt_stride", "i32"), ("scale", "fp32"))
    defines = (("H", num_heads), ("KVH", num_kv_heads), ("BS", block_size), ("TOPK", top_k), ("SPLIT", split))
    return CudaKernelSpec("msa_attention_mma", SOURCE, "msa_attn_decode", types, defines, 1, 0)


def _workspace(device: torch.device, tiles: int, split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Persistent split partials: O [tiles, split, 16, 128], (m, l) [tiles, split, 2, 16] float32, zeroed counters;
    split == 1 (the kernel writes the output directly) one tiny shared set, so large unsplit batches of varying T
    do not each keep a buffer."""
    parts = tiles * split if split > 1 else 0
    key = (tiles, split) if split > 1 else ()
    return persistent(("msa_attention_mma", str(device), *key),
                      lambda: (torch.empty(max(parts * 16 * HEAD_DIM, 4), dtype=torch.float32, device=device),
                               torch.empty(max(parts * 32, 4), dtype=torch.float32, device=device),
                               torch.zeros(max(tiles if split > 1 else 0, 4), dtype=torch.int32, device=device)))


def launch(runner: Runner, q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
           v_scale: torch.Tensor, sel: torch.Tensor, pos: torch.Tensor, qsl: torch.Tensor, seq: torch.Tensor,
           table: torch.Tensor, out: torch.Tensor, block_size: int, scale: float, split: int) -> None:
    """The decode kernel on checked inputs (as :func:`m3c.backends.kernels.msa_attention.msa_sparse_attention`
    checks them): grid T x KVH x split, one warp each."""
    t, h, _ = q.shape
    kvh, top_k = k_data.shape[2], sel.shape[-1]
    spec = decode_spec(h, kvh, block_size, top_k, split)
    ws, ml, cnt = _workspace(q.device, t * kvh, split)
    runner(spec, (t * kvh * split,),
           (q, k_data, k_scale.view(torch.uint8), v_data, v_scale.view(torch.uint8), sel, pos, qsl, seq, table, out,
            ws, ml, cnt, seq.shape[0], table.stride(0), float(scale)))
