"""MSA indexer decode scores on the tensor cores from CUDA C++ (``cuda/msa_indexer_mma.cu``): NVFP4 index keys read
in the paged cache's own layout, decoded in registers into ``mma.sync.m16n8k16`` f16 A fragments.

Why: the Triton decode paths stream the index keys at ~56% of the byte floor on the H200 (1M tokens, batch 8; Nsight
Compute: bound by instruction issue, ~3.8 SASS instructions per key value). The MegaMoE decode's CUDA recipe
(:mod:`m3c.backends.kernels.moe_cuda`: byte-permute decodes into MMA fragments) needs no prepacking here: the MMA's
K (the key's 128 elements) may be visited in any order as long as the query is staged in the same order, so each
lane takes one 16-byte quarter of a key's 64 code bytes, which is exactly the 32 K values (two scale groups) its
A fragments need over the 8 MMA steps of a 16-key tile.

Layout per lane (g = lane / 4, c = lane % 4) and 16-key tile: keys g and g + 8 of the tile (MMA rows), their code
bytes 16c .. 16c + 15 (elements 32c .. 32c + 31; byte i holds elements 32c + 2i (low nibble) and 32c + 2i + 1) and
scale bytes 2c, 2c + 1. MMA step s reads bytes 2s (A columns 2c, 2c + 1) and 2s + 1 (columns 2c + 8, 2c + 9); the
staged query pair i (f16) holds elements 32c + 2i, 32c + 2i + 1, so the B fragment of step s is pairs 2s, 2s + 1.

Numerics: an E2M1 value times its E4M3 scale has <= 5 significant bits in 2^-10 .. 2688, exact in f16 (one
``mul.f16x2`` per pair: codes -> f16 by ``prmt`` byte lookups, signs gathered by one more ``prmt``). A query column
((row, head) pair) is staged as f16 times 2^-e, e from its largest finite magnitude (|q| 2^-e < 2^15: f16 never
clips); the block maxima are scaled back by 2^e. bf16 queries (8 significant bits) are exact in f16 (elements below
2^-24 of the column's largest round to f16 subnormals), so scores are exact up to the float32 accumulation order.
float32 queries take two MMA columns each: hi = f16(q 2^-e) and lo = f16(q 2^-e - hi), summed after the MMA (22
significant bits; 4 query columns an MMA tile instead of 8). ±inf / NaN in q stay ±inf / NaN (their lo is 0), so
scores come out as the reference's IEEE dot products do (inf·0 = NaN); NaN propagates through the block max.

Launch (one kernel, grid (request, chunk of blocks), WARPS warps; the Triton top-k kernel follows): warp w of a CTA
takes blocks c_lo + w + WARPS·i of its chunk (<= 64 a warp: the lane holds two block-table entries), 64-key steps
with the next step's loads in registers while one is decoded; blocks past every column's position get -inf without
touching keys. Columns are (query row, index head) pairs of the request, 8·NT per pass (more: further passes).
Chunks aim at CTAS_PER_SM CTAs per SM for all requests at once (two waves of the resident CTAs).
"""

from __future__ import annotations

import functools

import torch
import triton

from m3c.backends.cuda_aot import CudaKernelSpec
from m3c.backends.triton_aot import Runner

SOURCE = "msa_indexer_mma.cu"
HEAD_DIM = 128  # the kernel's index head dim (64 code bytes + 8 scale bytes a key)
WARPS = 4
MIN_CTAS = {1: 3, 2: 2}
"""``__launch_bounds__`` minimum CTAs per SM by NT: NT = 1 capped at 168 registers (offline sm_90a: 196 uncapped, 2 CTAs
per SM; 4 CTAs spill 48 bytes a thread); NT = 2 takes 241 (3 CTAs would spill)."""
CTAS_PER_SM = 6
"""CTAs per SM the chunk size aims at: two waves of the 3 resident (MIN_CTAS) CTAs — H200, 1M tokens, batch 8,
scores + top-k, same run: 210.6 µs at 6 vs 216.9 at 3 (batch 1: 44.5 vs 44.2); 4 resident (MIN_CTAS 4: 128
registers, spilling) with 4 per SM took 224.4."""
MAX_BLOCKS_PER_WARP = 64  # the kernel's BTR = 2 block-table registers a lane


def supported(g: int, d: int, block_size: int, q_dtype: str) -> str | None:
    """None if the CUDA scores kernel takes this layout (any G; D = 128; a block size of 16, 32 or a multiple of 64:
    whole 64-key steps; bf16 or float32 queries), else the reason."""
    if d != HEAD_DIM:
        return f"index head dim {d}: the CUDA kernel takes {HEAD_DIM}"
    if block_size not in (16, 32) and (block_size < 64 or block_size % 64):
        return f"block size {block_size}: the CUDA kernel takes 16, 32 or multiples of 64"
    if q_dtype not in ("bf16", "fp32"):
        return f"index queries are {q_dtype}: the CUDA kernel takes bf16 or float32"
    if g < 1:
        return f"{g} index heads"
    return None


def call_supported(index_q: torch.Tensor, block_size: int) -> str | None:
    """:func:`supported` for one call's tensors, plus the device (CUDA, sm_89+ for ``cvt.f16x2.e4m3x2``, not the
    Triton interpreter)."""
    from m3c.backends.kernels.host import cuda_kernel_device

    why = cuda_kernel_device(index_q)
    if why:
        return why
    q_dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(index_q.dtype, str(index_q.dtype))
    return supported(index_q.shape[1], index_q.shape[2], block_size, q_dtype)


def column_tiles(rows: int, g: int, q_dtype: str) -> int:
    """MMA column tiles (NT) for decode tiles of ``rows`` rows x G heads: 1 while the query columns fit one tile (8
    bf16 / 4 float32 columns), else 2 (more columns take further passes over the keys)."""
    return 1 if rows * g <= (8 if q_dtype == "bf16" else 4) else 2


def scores_spec(block_size: int, nt: int, q_dtype: str) -> CudaKernelSpec:
    """The scores kernel's spec for a block size, NT and query dtype (reads the WARPS / MIN_CTAS knobs at every
    call)."""
    return _scores_spec(block_size, nt, q_dtype == "fp32", WARPS, MIN_CTAS[nt])


@functools.cache
def _scores_spec(block_size: int, nt: int, q_f32: bool, warps: int, min_ctas: int) -> CudaKernelSpec:
    args = ("q kd ks pos qsl seq bt out", "stride_qt stride_qg stride_bt MB G chunk")
    types = tuple((a, "*u8") for a in args[0].split()) + tuple((a, "i32") for a in args[1].split())
    defines = (("WARPS", warps), ("BS", block_size), ("NT", nt), ("Q_F32", int(q_f32)), ("MIN_CTAS", min_ctas))
    return CudaKernelSpec("msa_indexer_mma", SOURCE, "msa_index_scores", types, defines, warps, 0)


def pick_chunk(n_req: int, max_blocks: int, num_sms: int, warps: int | None = None) -> int:
    """Blocks per CTA: each request's table split into at most CTAS_PER_SM x SMs / requests chunks, a multiple of
    ``warps`` (default: WARPS, read at call time), at most MAX_BLOCKS_PER_WARP a warp."""
    warps = warps or WARPS
    per_req = max(1, CTAS_PER_SM * num_sms // max(n_req, 1))
    chunk = triton.cdiv(triton.cdiv(max(max_blocks, 1), per_req), warps) * warps
    return min(chunk, MAX_BLOCKS_PER_WARP * warps)


def index_scores(index_q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, positions: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scores: torch.Tensor,
                 block_size: int, rows: int, num_sms: int, runner: Runner, chunk_blocks: int | None = None) -> None:
    """Launch the scores kernel: scores [T, G, max_blocks] float32 (written whole) for a decode batch whose tiles hold
    ``rows`` rows. Inputs as :func:`m3c.backends.kernels.msa_indexer.msa_indexer` takes them (checked there), the
    batch metadata contiguous; the caller checks :func:`call_supported`."""
    g = index_q.shape[1]
    n_req, mb = block_table.shape
    vec = 16 // index_q.element_size()
    if index_q.data_ptr() % 16 or index_q.stride(0) % vec or index_q.stride(1) % vec or index_q.stride(2) != 1:
        index_q = index_q.clone(memory_format=torch.contiguous_format)  # 16-byte query loads: a fresh allocation
    q_dtype = "bf16" if index_q.dtype == torch.bfloat16 else "fp32"
    spec = scores_spec(block_size, column_tiles(rows, g, q_dtype), q_dtype)
    chunk = min(chunk_blocks or pick_chunk(n_req, mb, num_sms), MAX_BLOCKS_PER_WARP * WARPS)  # the kernel's limit
    runner(spec, (n_req, triton.cdiv(mb, chunk)),
           (index_q, k_data, k_scale.view(torch.uint8), positions, query_start_loc, seq_lens, block_table, scores,
            index_q.stride(0), index_q.stride(1), block_table.stride(0), mb, g, chunk))
