"""MSA indexer: NVFP4 index-key scores max-pooled per KV block, then exact top-k block selection.

Semantics: exactly ``m3c.model_defs.ops.select_blocks(ops.indexer_block_scores(...))`` over the paged
cache (reference: :mod:`m3c.model_defs.msa`), for decode, speculative rows and chunked prefill.

Launch (:func:`msa_indexer`). Two kernels, both launched as
``runner(spec, grid, runtime_args)`` (:data:`m3c.backends.triton_aot.Runner`: Triton's JIT by default,
or the runtime's offline-compiled cubins). Constexprs depend on static facts only (G, D, block size,
top_k, q dtype, max_q_rows, the phase and a bucket of the block-table width); :func:`indexer_specs`
lists every spec the launcher can produce. Phase rule (shapes only): ``T <= max_q_rows * R`` (T rows,
R requests) is decode, anything larger prefill. No host synchronization: CUDA-graph capturable, with
fixed grids for a given (T, R, max_blocks).

Kernel 1 ``indexer_scores_kernel``, grid (row tile, chunk of ``chunk_blocks`` blocks), tile fastest,
so the CTAs running at once share a chunk and its keys come from L2. A request's
block range is split into chunks so one long context (8,192 blocks = 1M tokens at block 128) spreads
over all SMs. Decode: a program per request, its rows (<= ROWS = max_q_rows rows × G heads; "fma":
min(max_q_rows, FMA_ROWS) rows) the MMA's M tile (more rows loop over tiles, keys re-read per tile).
Prefill: a program per tile of ``PREFILL_M // G`` consecutive rows of ONE request (128 rows × 1 head on
M3.1's TP4 slice); the grid is fixed by shapes, ``(T + R·(ROWS-1)) // ROWS`` tiles (>= sum_r
ceil(rows_r / ROWS)); each program finds its (request, first row) by a prefix sum over
``query_start_loc`` in registers, spare ones write nothing. Rows are causal one by one (own positions;
blocks past the tile's last position get -inf without touching keys). Per step a program loads NBT
whole blocks (>= 64 keys; "fma": FMA_KEYS keys) through the block table (packed E2M1 bytes + E4M3 scale
bytes; the MMA paths load a step's keys one step ahead and its table entries two ahead, in registers — Triton's
own pipelining waited for each step's loads right before using them — and skip the causal mask on steps
every row sees whole) and dequantizes in registers, exactly, even columns (low nibbles) and odd columns (high nibbles)
apart so no nibble interleave is needed. Decode dequant paths (the DEQ constexpr, ``deq=``; prefill
always uses "f32scale"):

- "f32scale": a nibble's bits placed into a float32 (3 integer ops; E2M1 e = 0 lands on
  subnormals, so every code reads as value × 2^-126), times its scale decoded as scale × 2^119 (one
  multiply per key value, the [KEYS, D/16] scales broadcast over their 16 values), converted to bf16
  (exact: <= 6 significant bits), the two nibbles of each byte joined back into element order for one
  [M, KEYS] dot, M = max(16, ROWS·G); the keys' 2^-7 is undone on the block maxima (a power of two).
  ~5 instructions per key value.
- "groupdot" (the default until "fma" measured faster): keys stay UNSCALED (E2M1 values, exact in bf16) and are the MMA's M dim (KEYS = 128:
  wgmma, A from registers); q is laid out block-diagonally, [D/2, (D/16)·M] (column h·M + m holds row
  m's q on group h's rows; M = max(ROWS·G, 16·16/D, 2)), so one dot pair yields every NVFP4 group's
  partial score [KEYS, (D/16)·M]; the group scales multiply those partials (KEYS·M·D/16 multiplies
  instead of KEYS·D) and a sum over groups gives the score. On the GPU with bf16 q the keys are built
  by inline PTX from four packed bytes: prmt spreads two bytes to 16-bit lanes, and/shift/or place a
  nibble's bits as a bf16 of value × 2^-126 and one ``mul.rn.bf16x2`` by 2^126 makes both exact
  (~2 instructions per key value); float32 q (and the interpreter) use float32 keys and IEEE dots.
  Exact in the same sense as "f32scale". Costs D/16 × the MMA work of a plain dot: fine while M is
  small (decode), ruinous for prefill tiles.
- "fp8": as "groupdot", but a nibble maps EXACTLY to an E4M3 byte by a bit shuffle, byte =
  (n & 8) << 4 | (n & 7) << 2 (value × 2^-6; E2M1 subnormal 0.5 → E4M3 subnormal), done by inline PTX
  on four packed bytes at a time (~1 instruction per key value), fed to FP8 MMA (K = D/2 >= 32, so
  D >= 64); the 2^-6 folds into the group scales. q is quantized to E4M3 per (row, head) with a
  power-of-two scale (row max in [128, 256)), rounded in integer arithmetic; LOSSY: q keeps 4
  significant bits, so scores differ from the reference by up to ~2^-5 relative and selections may
  differ (the benchmark measures how often). Exact when q already lies on the E4M3 grid after its
  power-of-two scale (and the FP8 MMA accumulates exactly).
- "fma": no MMA at all: CUDA-core FMAs, the decode tile's (row, head) pairs one by one (at most
  FMA_ROWS rows × G; a one-row tile skips the spare pairs) on each decoded step of FMA_KEYS keys. A
  step loads the codes as [KEYS, D/16, 2] int32 words (8 bytes a thread: one scale group's 16 values;
  nibble k of word h is element 8h + k) and the scales as [KEYS, D/16]. Nibble k moved to bits 28..31,
  shifted arithmetically by 6 and masked is e2m1_tiny's float (value × 2^-126, exact; 3 integer ops, 2
  for k = 7); a scale byte likewise reads as value × 2^-120, times 2^120 its plain value. Each pair's q
  is scaled once by 2^S (integer arithmetic on its max exponent: max|q·2^S| in [2^119, 2^120)) so
  nibble × q' products are normal (all but elements below 2^-117 of the row max); per pair and group a
  chain of 16 FMAs (in-thread) gives the partial, times the group scale, summed over groups, times
  2^(126 - S) (two exact power-of-two multiplies) gives the score. The only roundings are the float32
  accumulations. Per key value: 2.875 integer ops + 1 FMA per pair + ~1.4 of per-group and per-key work
  (scales, group sum, pooling, addresses): ~5.3 SASS instructions at one pair (sm_90, D = 128, 64 keys,
  4 warps, 54 registers), ~1.5 more per further pair (registers: FMA_ROWS).
- "int8": the "fma" tile (loop, loads, pooling) with integer math (:mod:`msa_indexer_int8`): q split
  exactly into three int8 parts per (row, head) (2^-20 of its row max is the only loss), the nibbles looked
  up as signed 2·E2M1 bytes by ``prmt`` and dotted four at a time by ``dp4a`` (int32, exact), one float
  conversion and scale per 16 values. A tile whose q holds ±inf / NaN runs the "fma" loop instead (its IEEE
  products give the reference's ±inf / NaN scores); the tile's finiteness is checked once, before the loop.
  With 4 warps no faster than "fma" on the H200 (1M tokens: batch 1 56.1 vs 52.7 µs, batch 8 293.9 vs 287.3);
  with 2 warps the fastest Triton path measured (``TRITON_DEQ``: what "auto" runs where the CUDA C++ kernel
  does not). Offline sm_90a, 2 warps: 3.8 SASS instructions per key value and 168 registers (6 programs per SM) since the prmt tables are operands kept in
  registers and the ±inf / NaN branch left the loop (was 4.2 and 200 registers, 5 per SM; not yet timed).
- "cuda" (and "auto", the default, where it runs): not a Triton kernel — the CUDA C++ scores kernel of
  :mod:`msa_indexer_cuda` (NVFP4 keys decoded by byte permutes straight into ``mma.sync`` fragments, the
  (row, head) columns as the MMA's N; D = 128, sm_89+). The top-k kernel below follows it as usual.
The inline PTX runs only on a GPU: the interpreter checks each path's algebra with the same values in
float32, and the tests check the bit formulas of the PTX on every byte in torch.

Scores are then masked per row (future keys -inf), max-pooled per block (NaN if a visible score is
NaN, as torch.amax) and stored as [T, G, max_blocks] float32.

Kernel 2 ``topk_blocks_kernel``, one program per (query row, group) — or, for decode launches of fewer rows
than SMs over tables wider than 1,024 blocks, up to TOPK_SLICES programs per row, each over a slice, the
last to finish merging their candidates (:func:`topk_plan`) —: streams the row's scores over
blocks 0..own (later blocks hold only future keys, hence -inf; CAUSAL=False scans all) in chunks of
CH, packing each score and its index into one int64 key (order-preserving float bits << 32 |
(2^31 - 1 - index)) so one max-reduction yields the best score with ties to the smaller index. A
set of top_k - 1 keys is kept in registers. The first chunk fills it with its top_k - 1 best keys, one
max-reduction each (the reductions are the cost: a block-wide one is a few hundred cycles, so the
earlier "replace the set's minimum" loop, ~4 reductions a step, took 17.7 µs at 8,192 blocks and 7.4
µs at 256 on the H200); each later chunk, while its best key beats the set's minimum, replaces it (at
most top_k - 1 times a chunk: no sort). CH is bucketed over the
block-table width (``TOPK_CH``: 1,024, or 8,192 = a 1M-token row in one chunk, 16 warps, no spills on
sm_90); wider tables take several chunks. The own block is excluded from candidates and added at
the end; NaN / -inf scores never qualify; -0.0 ties +0.0. The <= top_k indices are ranked pairwise
and scattered in ascending order, -1 padded.

Floors (per sparse layer, one GPU's slice). Decode: the index keys of every request's whole context,
read once: D/2 code bytes + D/16 scale bytes per token = 72 B/token at D = 128 (72 MiB = 17.6 µs at
4.28 TB/s for a 1M-token request); index-q, tables, block scores (4 B per block and row) are small
beside. Prefill, a 4K-row chunk at 1M context (G = 1, D = 128): 2 × 4096 × 2^20 × 128 = 1.10 TFLOP
(1.47 ms at 750 TFLOP/s bf16) — compute-bound; bytes: keys 75 MB once (tiles of one chunk hit L2) +
scores 4096 × 8192 × 4 B written and read by kernel 2 (268 MB, 63 µs). The dequant is repeated per
128-row tile: 32 × 134 M values on CUDA cores (~0.9 ms at ~7 ops each, overlapping the MMA). Dense
SDPA for the same chunk (16 heads) is ~35 TFLOP.

Contract: every token row belongs to a request (query_start_loc[-1] == T), positions lie in
[0, seq_len), blocks hold block_size tokens.

The kernels and their ``@triton.jit`` helpers live in :mod:`m3c.backends.kernels.msa_indexer_kernels`; this module
holds the knobs, specs, checks and launches.
"""

from __future__ import annotations

import functools

import torch
import triton

from m3c.backends.kernels import msa_indexer_cuda
from m3c.backends.kernels.batch_args import paged_batch, require_aligned
from m3c.backends.kernels.host import interpreting, num_sms, persistent
from m3c.backends.kernels.msa_indexer_kernels import indexer_scores_kernel, topk_blocks_kernel
from m3c.backends.kernels.prefill_tiles import prefill_tile_count
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError

DEQ_MODES = ("f32scale", "groupdot", "fp8", "fma", "int8")
"""The Triton decode dequant paths (the ``DEQ`` constexpr is the index): see the module docstring."""
DECODE_PATHS = ("auto", "cuda", *DEQ_MODES)
"""What ``deq=`` takes: a Triton path, "cuda" (the CUDA C++ scores kernel of :mod:`msa_indexer_cuda`; a named error
where it cannot run) or "auto" (the default: "cuda" where it runs — a CUDA sm_89+ device, D = 128, a block size that
is a multiple of 16 — else TRITON_DEQ)."""
DEFAULT_DEQ = "auto"
TRITON_DEQ = "int8"
"""The Triton decode dequant path "auto" falls back to: the fastest Triton path measured on the H200 (1M tokens, scores + top-k, 64 keys, 2
warps: batch 8 258.5 µs vs "fma" 274.4, batch 1 47.2 vs 50.3; session 11: "fma" 66 µs at batch 1 against
107 "groupdot", 128 "f32scale", 89 "fp8"). Its only loss, 2^-20 of each query row's max, is the size of
float32 accumulation-order differences (the reference sums in another order anyway); its selections equaled
the reference's at every benchmarked point. "fma" is the float32 twin; "fp8" is lossy (its query rounding
changed 87.5% of the selected blocks at 32K), so it is never a default. Plain decode (no more rows than
requests) gets 1-row tiles whatever ``max_q_rows`` says (:func:`decode_rows`); more rows get FMA_ROWS = 2-row
tiles."""

FMA_KEYS = 64
"""Keys per step of the "fma" and "int8" paths (a power of two; below the block size a block takes several steps)."""
FMA_WARPS = 2
"""Warps of the "fma" and "int8" paths' programs (H200, 1M tokens, batch 8: 2 warps 258.5 / 274.4 µs for int8 /
fma against 293.9 / 287.3 with 4; 1 warp with 32 keys 264.3 / 320.8)."""
FMA_STAGES = 3
"""How the "fma" and "int8" paths' block loop brings its keys in: n >= 1 uses Triton's ``tl.range(num_stages=n)``
(1: loads issued in the step that uses them; > 1: cp.async through shared memory, n - 1 steps ahead; H200, 1M
tokens, batch 1, scores + top-k: 1-row tiles 66.4 µs at 1 stage, 66.4 at 2, 62.1 at 3; batch 8: 358.2 at 1,
302.8 at 3); 0 loads the next step's keys into registers while the current step computes (steps of whole blocks:
FMA_KEYS >= block size, else 3). Register prefetch was measured slower (1M, batch 8, 128 keys: fma 409.9 /
int8 270.4 µs at 4 warps against 274.4 / 258.5 for 64 keys, 2 warps, 3 stages): Nsight Compute shows the
kernel bound by instruction issue (67% of issue slots), not by its loads."""
FMA_ROWS = 2
"""Query rows per tile of the "fma" and "int8" paths (at most; more rows loop over tiles, keys re-read per tile). The
tile's rows × G (row, head) pairs share each decoded key step but hold their q in registers, and a kernel
holds the registers of its largest tile (sm_90, D = 128, G = 1: 54 at 1 row, 96 at 2, 168 at 4, 255 at 8)."""

CHUNK_WAVES = 4
"""Decode scores programs per SM the block-chunk split aims for (:func:`pick_chunk_blocks`). H200, "int8", 2
warps: more, shorter programs lose (1M tokens, batch 1: 47.2 µs at 4, 59.6 at 16, 74.2 at 32; batch 8: 258.6 /
266.3 / 281.5), so does 2 (batch 8: 305.1 with 256-block chunks)."""
CHUNK_MAX = 128
"""Most blocks one decode scores program covers: at 1M tokens and batch 8, 128-block chunks make 528 programs, all
resident at once (6 per SM at 2 warps), and took 248.5 µs against 258.6 with 64-block chunks (1,024 programs,
1.3 waves); other points unchanged."""

PREFILL_M = 128
"""Prefill M tile: ``max(1, PREFILL_M // G)`` query rows × G index heads per program."""

TOPK_CH = (1024, 8192)
"""Top-k chunk widths, bucketed over block-table widths (8,192 blocks = 1M tokens at block 128)."""
TOPK_SLICES = 8
"""Most slices a decode row's top-k is split into (:func:`topk_plan`; a power of two)."""
TOPK_RANK_MERGE = 0
"""When > 0, the sliced top-k's merge ranks the NSMAX × KO candidates pairwise in one pass (a [N, N] compare) when
N is at most this, else (and at 0, the default) it takes them by K - 1 block-wide max-reductions. Off until timed
on a GPU (written after session 15's device time ran out; offline sm_90a at 8 slices × 16: 172 registers instead
of 48, no spills; prediction: −0.5–1.5 µs of the ~10 µs top-k at 512K–1M). `device_check.sh sweep` times it."""
TOPK_WARPS = 0
"""Warps of a top-k program (0: by its chunk width, 4..16). A tuning knob (with TOPK_CH / TOPK_SLICES: e.g. one warp
over 128-block slices makes every reduction a warp shuffle instead of a shared-memory round trip), read at every
call."""


def pick_chunk_blocks(n_prog: int, max_blocks: int, nbt: int, num_sms: int) -> int:
    """Blocks per kernel-1 program: ~CHUNK_WAVES programs per SM over ``n_prog`` row tiles, 2..CHUNK_MAX blocks
    each (a multiple of nbt)."""
    want = triton.cdiv(n_prog * max_blocks, CHUNK_WAVES * num_sms)
    chunk = min(max(want, 2, nbt), CHUNK_MAX, max(max_blocks, 1))
    return triton.cdiv(chunk, nbt) * nbt


def is_prefill(num_rows: int, num_requests: int, max_q_rows: int) -> bool:
    """The phase rule (shapes only): more than ``max_q_rows`` rows per request on average is prefill."""
    return num_rows > max_q_rows * num_requests


def decode_rows(num_rows: int, num_requests: int, max_q_rows: int) -> int:
    """The decode tile's rows (shapes only): 1 when there are no more rows than requests (plain decode: a
    tile sized for max_q_rows holds the registers of its largest variant, which cost the "fma" path 35% at
    1M tokens on the H200: 89.5 vs 66.4 µs), else max_q_rows (rows past a tile loop over further tiles)."""
    return 1 if num_rows <= num_requests else max_q_rows


def _nbt(block_size: int) -> int:
    return max(1, 64 // block_size)


def _scores_spec(g: int, d: int, block_size: int, q_dtype: str, rows: int, prefill: bool, deq: str,
                 upcast: bool) -> KernelSpec:
    """The scores kernel's spec; the "fma" / "int8" tuning knobs (FMA_KEYS, FMA_WARPS, FMA_ROWS, FMA_STAGES) are read
    here, at every call, and are part of the cached builder's key: changing them takes effect at once."""
    knobs = (FMA_KEYS, FMA_WARPS, FMA_ROWS, FMA_STAGES) if deq in ("fma", "int8") else (0, 0, 0, 1)
    return _build_scores_spec(g, d, block_size, q_dtype, rows, prefill, deq, upcast, knobs)


def _fma_stages(stages: int, keys: int, block_size: int) -> int:
    """FMA_STAGES as the kernel takes it: register prefetch (0) needs steps of whole blocks (keys >= block size);
    smaller steps fall back to Triton's 3-stage cp.async pipelining."""
    return 3 if stages == 0 and keys < block_size else stages


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def _build_scores_spec(g: int, d: int, block_size: int, q_dtype: str, rows: int, prefill: bool, deq: str,
                       upcast: bool, knobs: tuple[int, int, int, int]) -> KernelSpec:
    fma_keys, fma_warps, fma_rows, fma_stages = knobs
    ng = d // 16
    dq = DEQ_MODES.index(deq)
    fma = deq in ("fma", "int8")  # the CUDA-core paths share the "fma" tile and its knobs
    nbt = max(1, fma_keys // block_size) if fma else _nbt(block_size)
    rows = min(rows, fma_rows) if fma else rows
    m = triton.next_power_of_2(rows * g)
    if not fma:
        m = max(m, 16) if dq == 0 else max(m, triton.cdiv(16, ng), 2)  # tl.dot: every dim >= 16
    consts = dict(G=g, D=d, BS=block_size, NBT=nbt, ROWS=rows, M=m, FILL=32, PREFILL=prefill, RB=64, DEQ=dq,
                  UPCAST=upcast, FK=fma_keys if fma else 0, FS=_fma_stages(fma_stages, fma_keys, block_size) if fma else 1)
    types = {"q_ptr": f"*{q_dtype}", "kd_ptr": "*u8", "ks_ptr": "*u8", "pos_ptr": "*i64", "qsl_ptr": "*i32",
             "seq_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*fp32", "stride_qt": "i32", "stride_qg": "i32",
             "stride_bt": "i32", "MB": "i32", "NR": "i32", "chunk_blocks": "i32"}
    warps = fma_warps if fma else 8 if prefill or nbt * block_size * d >= 8192 else 4
    return KernelSpec("msa_indexer_scores", indexer_scores_kernel, types, consts, warps, 3,
                      divisible_16=("kd_ptr", "ks_ptr", "out_ptr"))


def _topk_spec(g: int, block_size: int, top_k: int, ch: int) -> KernelSpec:
    """The top-k kernel's spec (reads the TOPK_SLICES / TOPK_WARPS knobs at every call)."""
    return _build_topk_spec(g, block_size, top_k, ch, TOPK_SLICES, TOPK_WARPS, TOPK_RANK_MERGE)


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def _build_topk_spec(g: int, block_size: int, top_k: int, ch: int, slices: int, warps: int,
                     rank_merge: int = 0) -> KernelSpec:
    ko = max(2, triton.next_power_of_2(top_k))
    consts = dict(G=g, BS=block_size, K=top_k, KO=ko, CH=ch, CAUSAL=True, NSMAX=slices,
                  RANK_MERGE=0 < slices * ko <= rank_merge)
    types = {"scores_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*i64", "cand_ptr": "*i64", "cnt_ptr": "*i32",
             "MB": "i32"}
    return KernelSpec("msa_topk_blocks", topk_blocks_kernel, types, consts, warps or max(4, min(16, ch // 512)), 1,
                      divisible_16=("scores_ptr", "out_ptr"))


def _topk_ch(max_blocks: int) -> int:
    return next((c for c in TOPK_CH if max_blocks <= c), TOPK_CH[-1])  # wider tables: the chunk loop


def topk_plan(rows: int, max_blocks: int, num_sms: int) -> tuple[int, int]:
    """(chunk width CH, slices per row) of the top-k launch, from shapes only. Few rows (decode) split each row
    into up to TOPK_SLICES slices of <= TOPK_CH[0] blocks, merged exactly by the last slice to finish (one
    program per row spends ~1 µs per block-wide reduction over 8,192 blocks, 15 of them: 14.8 µs at 1M on the
    H200); prefill-sized launches (rows >= SMs) keep one program per row."""
    if rows >= num_sms or max_blocks <= TOPK_CH[0]:
        return _topk_ch(max_blocks), 1
    return TOPK_CH[0], min(TOPK_SLICES, triton.cdiv(max_blocks, TOPK_CH[0]))


def _topk_workspace(device: torch.device, rows: int, ko: int, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent candidate keys [rows, TOPK_SLICES, ko] and zeroed counters [rows] of split top-k launches
    (:func:`~m3c.backends.kernels.host.persistent`); unsplit launches get a tiny unused pair. Split launches
    have fewer rows than SMs, so these stay small."""
    n = rows if split else 1
    return persistent(("msa_topk", str(device), n, ko, TOPK_SLICES),
                      lambda: (torch.empty(n * TOPK_SLICES * ko, dtype=torch.int64, device=device),
                               torch.zeros(n, dtype=torch.int32, device=device)))


def _prefill_rows(g: int, prefill_m: int) -> int:
    return max(1, prefill_m // g)


def indexer_specs(g: int, d: int, block_size: int, top_k: int, q_dtype: str = "bf16", max_q_rows: int = 8, *,
                  deq: str = DEFAULT_DEQ, prefill_m: int = PREFILL_M, upcast: bool = False) -> list[KernelSpec]:
    """Every KernelSpec :func:`msa_indexer` can launch for this layout (GPU settings unless ``upcast``):
    the decode and the prefill scores kernels, then the top-k kernel at each chunk width of TOPK_CH."""
    if q_dtype not in ("bf16", "fp32"):
        raise ShapeError(f"q_dtype={q_dtype!r}: expected 'bf16' or 'fp32'")
    if deq not in DECODE_PATHS:
        raise ShapeError(f"deq={deq!r}: expected one of {DECODE_PATHS}")
    if d < 32 or d & (d - 1):
        raise ShapeError(f"index head dim {d} must be a power of two >= 32")
    if block_size < 1 or block_size & (block_size - 1) or top_k < 1 or max_q_rows < 1 or g < 1:
        raise ShapeError(f"block_size={block_size} must be a power of two; top_k={top_k}, max_q_rows={max_q_rows} "
                         f"and index heads {g} must be >= 1")
    why = "the Triton interpreter runs no CUDA C++" if upcast else msa_indexer_cuda.supported(g, d, block_size, q_dtype)
    if deq == "cuda" and why:
        raise ShapeError(f"deq='cuda': {why}")
    if deq in ("auto", "cuda") and why is None:
        decode = [msa_indexer_cuda.scores_spec(block_size, nt, q_dtype)
                  for nt in sorted({msa_indexer_cuda.column_tiles(rows, g, q_dtype) for rows in (1, max_q_rows)})]
    else:
        deq = TRITON_DEQ if deq == "auto" else deq
        decode = [_scores_spec(g, d, block_size, q_dtype, rows, False, deq, upcast) for rows in sorted({1, max_q_rows})]
    return [*decode,
            _scores_spec(g, d, block_size, q_dtype, _prefill_rows(g, prefill_m), True, "f32scale", upcast),
            *(_topk_spec(g, block_size, top_k, ch) for ch in TOPK_CH)]


def _decode_path(deq: str, index_q: torch.Tensor, block_size: int) -> str:
    """The decode path a call runs: "auto" -> "cuda" where the CUDA kernel runs, else TRITON_DEQ; "cuda" where it
    cannot run -> ShapeError with the reason; a Triton path as given."""
    if deq not in ("auto", "cuda"):
        return deq
    why = msa_indexer_cuda.call_supported(index_q, block_size)
    if why is None:
        return "cuda"
    if deq == "cuda":
        raise ShapeError(f"deq='cuda': {why}; use deq='auto' (falls back to the Triton '{TRITON_DEQ}' path)")
    return TRITON_DEQ


def _check(index_q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, block_size: int, top_k: int,
           max_q_rows: int, deq: str) -> None:
    """The queries, the index-key cache and the launch settings (the batch metadata: `paged_batch`)."""
    if index_q.dim() != 3:
        raise ShapeError(f"index_q has shape {tuple(index_q.shape)}: expected [T, G, D]")
    if index_q.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"index_q has dtype {index_q.dtype}: expected bfloat16 or float32 (convert it first)")
    d = index_q.shape[2]
    if d < 32 or d & (d - 1):
        raise ShapeError(f"index head dim {d} must be a power of two >= 32")
    if deq not in DECODE_PATHS:
        raise ShapeError(f"deq={deq!r}: expected one of {DECODE_PATHS}")
    if deq == "fp8" and d < 64 and not interpreting():
        raise ShapeError(f"deq='fp8' needs index head dim >= 64 (FP8 MMA K = D/2 >= 32), got {d}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ShapeError(f"block_size={block_size} must be a power of two")
    if k_data.dim() != 4 or tuple(k_data.shape[1:]) != (block_size, 1, d // 2) or k_data.dtype != torch.uint8:
        raise ShapeError(f"k_data {tuple(k_data.shape)} {k_data.dtype}: expected uint8 [NB, {block_size}, 1, {d // 2}]")
    if tuple(k_scale.shape) != (k_data.shape[0], block_size, 1, d // 16) or k_scale.element_size() != 1:
        raise ShapeError(f"k_scale {tuple(k_scale.shape)}: expected float8_e4m3fn [NB, {block_size}, 1, {d // 16}]")
    if not (k_data.is_contiguous() and k_scale.is_contiguous()):
        raise ShapeError("k_data / k_scale must be contiguous (the kernel addresses blocks by their index)")
    if any(x.device != index_q.device for x in (k_data, k_scale)):
        raise ShapeError(f"k_data / k_scale are on {k_data.device} / {k_scale.device}, index_q on {index_q.device}: "
                         "move them to one device")
    if top_k < 1 or max_q_rows < 1:
        raise ShapeError(f"top_k={top_k} and max_q_rows={max_q_rows} must be >= 1")


def msa_indexer(
    index_q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    top_k: int,
    *,
    max_q_rows: int = 8,
    runner: Runner = jit_run,
    scores_out: torch.Tensor | None = None,
    selected_out: torch.Tensor | None = None,
    deq: str = DEFAULT_DEQ,
    prefill_m: int = PREFILL_M,
    chunk_blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scores float32 [T, G, max_blocks] and selected blocks int64 [T, G, top_k] (two launches).

    ``index_q`` [T, G, D] float32 / bf16; ``k_data`` uint8 [NB, block_size, 1, D/2] and ``k_scale``
    float8_e4m3fn [NB, block_size, 1, D/16] (the paged NVFP4 index-key cache); batch metadata as in
    :class:`m3c.model_defs.kv_cache.BatchMetadata` (int64 positions, int32 starts / lengths / table).
    ``T <= max_q_rows * R`` runs the decode configuration (a program per request and block chunk),
    otherwise the prefill one (a program per ``prefill_m // G``-row tile and block chunk). ``deq``
    picks the decode dequant path (``DEQ_MODES``; prefill always uses "f32scale"). ``scores_out`` /
    ``selected_out``: optional preallocated outputs. ``chunk_blocks`` overrides the blocks per program
    (a runtime argument). Launch shapes come from tensor sizes only; no host synchronization.
    """
    _check(index_q, k_data, k_scale, block_size, top_k, max_q_rows, deq)
    meta = paged_batch(positions, query_start_loc, seq_lens, block_table, index_q.shape[0], index_q.device)
    positions, query_start_loc, seq_lens, block_table = (x.contiguous() for x in meta)  # no-ops for BatchMetadata
    t, g, d = index_q.shape
    n_req, mb = block_table.shape
    dev = index_q.device
    scores = scores_out if scores_out is not None else torch.empty((t, g, mb), dtype=torch.float32, device=dev)
    selected = selected_out if selected_out is not None else torch.empty((t, g, top_k), dtype=torch.int64, device=dev)
    if tuple(scores.shape) != (t, g, mb) or tuple(selected.shape) != (t, g, top_k):
        raise ShapeError(f"outputs {tuple(scores.shape)}, {tuple(selected.shape)}: expected ({t}, {g}, {mb}), "
                         f"({t}, {g}, {top_k})")
    if scores.dtype != torch.float32 or selected.dtype != torch.int64 or not (
            scores.is_contiguous() and selected.is_contiguous()):
        raise ShapeError("scores_out must be contiguous float32 and selected_out contiguous int64")
    if t == 0 or n_req == 0 or mb == 0:
        return scores, selected
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    require_aligned(k_data=k_data, k_scale=k_scale, scores_out=scores, selected_out=selected)
    q_name = "bf16" if index_q.dtype == torch.bfloat16 else "fp32"
    prefill = is_prefill(t, n_req, max_q_rows)
    if prefill:
        rows = _prefill_rows(g, prefill_m)
        spec = _scores_spec(g, d, block_size, q_name, rows, True, "f32scale", interpreting())
        n_prog = prefill_tile_count(t, n_req, rows)
    else:
        rows = decode_rows(t, n_req, max_q_rows)
        deq = _decode_path(deq, index_q, block_size)
        spec = None if deq == "cuda" else _scores_spec(g, d, block_size, q_name, rows, False, deq, interpreting())
        n_prog = n_req
    if spec is None:
        msa_indexer_cuda.index_scores(index_q, k_data, k_scale, positions, query_start_loc, seq_lens, block_table,
                                      scores, block_size, rows, num_sms(dev), runner, chunk_blocks)
    else:
        chunk = chunk_blocks or pick_chunk_blocks(n_prog, mb, spec.constexprs["NBT"], num_sms(dev))
        runner(spec, (n_prog, triton.cdiv(mb, chunk)),
               (index_q, k_data, k_scale.view(torch.uint8), positions, query_start_loc, seq_lens, block_table, scores,
                index_q.stride(0), index_q.stride(1), block_table.stride(0), mb, n_req, chunk))
    ch, n_sl = topk_plan(t * g, mb, num_sms(dev))
    spec = _topk_spec(g, block_size, top_k, ch)
    cand, cnt = _topk_workspace(dev, t * g, spec.constexprs["KO"], n_sl > 1)
    runner(spec, (t * g, n_sl), (scores, positions, selected, cand, cnt, mb))
    return scores, selected
