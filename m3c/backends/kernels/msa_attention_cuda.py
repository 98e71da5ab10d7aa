"""MSA sparse-attention decode on the tensor cores from CUDA C++ (``cuda/msa_attention_mma.cu``), on by default
(:data:`m3c.backends.kernels.msa_attention.ATTN_CUDA`) where it runs; the Triton decode kernel elsewhere.

Design: a CTA of WARPS = 4 warps per (query row, KV group, split); a row's work is TOPK × BS/64 64-key steps (units),
dealt round-robin to the SPLIT × WARPS warps (split 8 at small batches: one step a warp). The group's HG <= 16 query
heads are one m16 MMA tile (rows past HG are zeros, never stored). Per 64-key step:
- S = Q K^T with keys as the MMA's N: lane (g, c) loads the 16-byte quarter c of key 8j + g (its 32 K values over
  the 8 MMA steps, the indexer kernel's layout) and decodes it by byte permutes into f16 B fragments (exact);
  Q is staged once as f16 × 2^-e per head (bf16 queries are exact in f16), so scores are q.k × 2^e × scale in the
  log2 domain.
- Online softmax in registers (keys past the row's position are -inf), P rounded to f16 straight from the S
  fragments into the A fragments of P V (the C layout of two n8 tiles is the A layout of one k16 step).
- O += P V with both the key order and the output-dim order free: lane (g, c) owns output dims 16g .. 16g + 15
  (tile jd's column g is dim 16g + jd), i.e. one scale group and 8 contiguous code bytes of each of its 4 keys a
  k16 step; two keys' nibbles are interleaved by byte permutes so one decode yields (key A, key B) f16 pairs, times
  the (scale A, scale B) pair. Keys past the position read as zeros (the cache may hold NaN).
- All of a step's K and V loads are issued before its first MMA (LOADFENCE with one step a warp: a never-taken
  branch on the loaded words keeps ptxas from sinking loads past the MMAs, i.e. one DRAM round trip a step).
The CTA's warps merge exactly through 33 KiB of shared memory (fixed warp order). Splits (2..8, sm_90+) form one
thread-block cluster (``__cluster_dims__``): each CTA keeps its merged (O, m, l) in shared memory, and after a
cluster barrier CTA s merges heads s, s + SPLIT, ... from all of them through distributed shared memory (fixed
order), a second barrier keeping every CTA's shared memory alive until then. On sm_89 and above 8 splits the
splits write (O, m, l) to a workspace and the last CTA to arrive merges them (acq_rel fences around one atomic).
A row past ``query_start_loc[R]`` (a padded batch) outputs zeros. Numerics: P in f16 (the Triton kernel rounds P
to bf16), ex2.approx. 164-247 registers, no spills (offline sm_90a).

Measured on the H200 (benchmarks/RESULTS.md, session 15): 9.4 / 9.8 / 16.0 µs at batch 1 / 8 / 32 (Triton's
kernel 13.8 / 14.1 / 23.1, same run); 4,096-row prefill chunks ~630 µs (Triton ~1,320). Of the 9.4: ~2.5 µs the
prologue and output, ~6 µs the first 64-key step of a warp (the selection -> block table -> K/V load chain, then
~3,000 instructions at one warp a scheduler), the rest the cluster merge (the global-memory merge cost ~4 µs).
"""

from __future__ import annotations

import functools

import torch

from m3c.backends.cuda_aot import CudaKernelSpec
from m3c.backends.kernels.host import cuda_kernel_device, num_sms, persistent
from m3c.backends.triton_aot import Runner

SOURCE = "msa_attention_mma.cu"
HEAD_DIM = 128
WARPS = 4  # a CTA: its warps merge through 33 KiB of shared memory


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


def splits(top_k: int, block_size: int, warps: int = WARPS) -> list[int]:
    """The split counts (CTAs a row and KV group) the launcher picks from and :func:`specs` lists: powers of two
    while every warp still gets a 64-key step of the top_k blocks."""
    units = top_k * (block_size // 64)
    out = [1]
    while out[-1] * 2 * warps <= units and out[-1] * 2 * 32 <= warps * 16 * (HEAD_DIM + 4):  # the .cu's assert
        out.append(out[-1] * 2)
    return out


def pick_split(tiles: int, top_k: int, block_size: int, device: torch.device) -> int:
    """The largest listed split with at most one CTA an SM (tiles × split <= SMs), at least 1. H200, one row, top-16
    of 128-token blocks (RESULTS.md, session 15): 8 splits best at batch 1 and 8 (9.4 / 9.8 µs), 4 at batch 32
    (16.0 µs; 8: 20.3)."""
    buckets = splits(top_k, block_size)
    fits = [s for s in buckets if tiles * s <= num_sms(device)]
    return max(fits) if fits else 1


@functools.cache
def decode_spec(num_heads: int, num_kv_heads: int, block_size: int, top_k: int, split: int,
                warps: int = WARPS) -> CudaKernelSpec:
    """The kernel's spec for a layout, split and CTA size."""
    ptrs = ["q", "kd", "ks", "vd", "vs", "sel", "pos", "qsl", "seq", "bt", "out", "ws", "ml", "cnt"]
    types = (*((a, "*u8") for a in ptrs), ("n_req", "i32"), ("bt_stride", "i32"), ("scale", "fp32"))
    defines = (("H", num_heads), ("KVH", num_kv_heads), ("BS", block_size), ("TOPK", top_k), ("SPLIT", split),
               ("WARPS", warps))
    return CudaKernelSpec("msa_attention_mma", SOURCE, "msa_attn_decode", types, defines, warps, 0)


def specs(num_heads: int, num_kv_heads: int, block_size: int, top_k: int) -> list[CudaKernelSpec]:
    """Every spec :func:`launch` can pick for this layout (for AOT compiles)."""
    return [decode_spec(num_heads, num_kv_heads, block_size, top_k, s) for s in splits(top_k, block_size)]


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
           table: torch.Tensor, out: torch.Tensor, block_size: int, scale: float, split: int | None = None,
           warps: int = WARPS) -> None:
    """The decode kernel on checked inputs (as :func:`m3c.backends.kernels.msa_attention.msa_sparse_attention`
    checks them): grid T x KVH x split CTAs of ``warps`` warps; ``split`` None picks a listed one."""
    t, h, _ = q.shape
    kvh, top_k = k_data.shape[2], sel.shape[-1]
    if split is None:
        split = pick_split(t * kvh, top_k, block_size, q.device)
    spec = decode_spec(h, kvh, block_size, top_k, split, warps)
    ws, ml, cnt = _workspace(q.device, t * kvh, split)
    runner(spec, (t * kvh * split,),
           (q, k_data, k_scale.view(torch.uint8), v_data, v_scale.view(torch.uint8), sel, pos, qsl, seq, table, out,
            ws, ml, cnt, seq.shape[0], table.stride(0), float(scale)))
