"""MegaMoE decode on the tensor cores from CUDA C++ (``cuda/moe_decode_mma.cu``): 1 <= T <= 64 tokens.

Why CUDA C++: every Triton decode tiling measured on the H200 sat at 20-26% of the NVFP4 byte floor; the decoded
weights went through shared memory to reach the MMA and each weight cost 6-8.5 SASS instructions (Nsight Compute,
benchmarks/RESULTS.md sessions 11-12). Here each thread loads its own bytes of a prepacked layout (one 16-byte
load per 32 weights), turns them into the A fragments of ``mma.sync.m16n8k16`` f16 with byte permutes (``prmt``:
E2M1 magnitude -> f16 high byte, sign bits OR-ed in) and one ``mul.f16x2`` by the block scale, and the tokens are
the MMA's N (8 columns; 1-8 tokens cost the same MMA). ~2.3 SASS instructions per weight (offline sm_90a: 663 per
256 weights a thread), 128 registers; on the H200 60-65% of the byte floor for T <= 8 (benchmarks/RESULTS.md,
session 13), ~2.8x the Triton tiles.

Launches (one stream, no host sync, CUDA-graph safe for a fixed T):
0. (:func:`route_stage`, ``cuda/moe_route.cu``; megamoe's default) ``moe_route_stage``: the float32 router GEMV
   over ceil(E / 8) x KSPLIT CTAs (one expert a warp, a K slice of 128 CH a CTA; float32 partial sums to a persistent
   workspace), the last CTA to arrive (atomic counter, left at zero) merges them in ks order and routes every
   token as ``MoE.route`` (sigmoid with an accurate exp and IEEE division, + bias for the selection, top-k by warp
   ``redux`` rounds with ties to the smaller expert and NaN above everything as torch.sort, weights normalized in
   slot order, times the scaling factor); T more CTAs do step 1's staging in the same launch. It replaces the
   cuBLAS GEMV + ``fused_route`` + ``moe_stage_x`` (3 launches).
1. ``moe_stage_x``: the tokens as f16 times 2^-e per token (e from the token's largest magnitude, so f16's range
   never clips; the MMA's f32 result is scaled back); skipped when the caller passes them staged (step 0).
2. ``moe_fc1``: CTAs over (shared expert | touched expert slot) x 128-row block x K split (routed: 2 NT when H
   allows; the shared expert's MXFP8 rows, twice the bytes, twice that); each copies its K range of the staged
   tokens that picked its expert to shared memory, compacted (they are its MMA columns: one 8-column tile when at
   most 8 tokens picked it, else NT; the shared expert's CTAs take every token and stage them from x themselves, so
   they need nothing of step 0 and run first; in the builds :data:`EARLY_LOAD` names each warp issues its first
   super-chunk's loads before that copy), then every warp streams two 16-row tiles (the next 256-K
   super-chunk's 16-byte loads in flight while one is decoded): h[ks, pair, row] = partial sums. Above 8 tokens
   the columns come in groups of 8 NT (NT = 1 up to :data:`NT1_MAX_TOKENS` tokens, else 2): a routed CTA runs its
   expert's groups one after another (a second group only when more than 8 NT tokens picked the expert; it reads
   the CTA's weights again, from L2 where they still are), the shared expert gets a CTA per group, the groups of one
   row block side by side in the grid.
3. ``moe_act``: act = SiLU(gate) * up from h's splits (rounded to bf16 as the reference's bf16 model does), staged
   like the tokens, one CTA per (token, expert) pair.
4. ``moe_fc2``: act times W2 (routed NVFP4 or the MXFP8 shared expert, 2 K splits), times the routing weight:
   y[ks, pair, :]; its columns compacted as FC1's.
5. ``moe_combine``: out[n] = sum_k y[n * topk + k] (+ the shared rows), in a fixed order (deterministic).
Where FC1's and FC2's grids fit one wave (:func:`one_wave`; one token at m3.1-small's width) steps 3 and 5 are
folded into 2 and 4 (:data:`FOLD_ACT`, :data:`FOLD_COMBINE`): the last CTA to finish an act chunk computes it, FC2
stages act with each row's scale itself, and the last FC2 CTA of a row block sums that block of the output; bitwise
the launches' output.
Touched experts are found on the device from topk_ids (the CTAs of unused slots exit at once). Steps 2-5 can be
programmatic dependent launches (:data:`PDL`): each waits on its predecessor with ``griddepcontrol.wait`` before
reading its outputs or writing anything.

:data:`NATURAL` (off until run on a GPU) reads the routed NVFP4 experts in their own layout instead (lane (g, j)
of a 16-row tile: 16-byte pieces j, j + 4 of rows g, g + 8 per 256-K super-chunk, decoded by ptx_common's decode8,
the tokens read at the same K; ~7% more SASS instructions in FC1), so only the small shared expert is prepacked.

Prepacked layouts (:func:`prepack_nvfp4`, :func:`prepack_mxfp8`; built once per weight, cached on the tensor):
rows in tiles of 16 (row 16 t + 8 h + g), lanes 4 g + j. NVFP4: K in super-chunks of 256 = 4 chunks of 64;
chunk c, lane j covers the scale group q = 4c + j (16 K values) in 4 MMA steps of 4 K (k = 16q + 4s + e); codes
``[tile][sc][c][lane][s]`` u32 words, each holding rows g and g + 8 x e = 0..3 (magnitudes: nibble i -> e = i % 2,
h = i // 2 for e < 2, nibble 4 + i for e >= 2; signs at bits 8i + 7 / 8i + 3), scales ``[tile][sc][lane][c][h]``.
Each MMA step sums 4 lanes' different groups, so the scale multiplies the decoded weights (exact in f16:
value x scale has <= 5 significant bits, 2^-10 .. 2688). MXFP8: super-chunks of 128 = 8 steps of 16 K, step q
lane j k = 16q + 4j + e (one E8M0 group per step: the scale multiplies the MMA's f32 result); codes
``[tile][sc][q // 2][lane][q % 2][e // 2][h][e % 2]`` bytes; scales in their natural [rows, K / 32] layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import triton

from m3c.backends.cuda_aot import CudaKernelSpec, arg_types
from m3c.backends.kernels.host import derived, derived_ready, persistent, persistent_ready
from m3c.backends.targets.hopper import HOPPER
from m3c.backends.triton_aot import Runner, jit_run
from m3c.errors import ConfigError, M3CError, ShapeError
from m3c.model_defs.quant import MXFP8Tensor, NVFP4Tensor

SOURCE = "moe_decode_mma.cu"
ROUTE_SOURCE = "moe_route.cu"
ROUTE_MAX_EXPERTS = 256  # 32 x ESLOTS experts per routing warp (8 registers of keys a lane at most)
ROUTE_MAX_TOPK = 64  # the routing kernel's per-warp selection buffers
_ROUTE_CTAS = 264  # the GEMV grid's target: at most 2 CTAs per SM of an H200 (132 SMs), all resident at once
WARPS = 4
"""Warps per FC1 / FC2 CTA (1, 2 or 4): a CTA covers 32 WARPS weight rows (2 tiles of 16 a warp). 4 ships; 1 and 2
are for benchmarks that size the grid (one warp takes only the NT = 1 builds' T <= 32: find_tokens compacts 32
tokens a warp). The register caps scale with it (NT = 1: 128 a thread, 16 warps an SM; FC1_MIN_CTAS counts CTAs of
4 warps), but each CTA stages its tokens' K range whatever its size (FC1 at NT = 1, H = 6144: 49 KB, 4 CTAs an
SM), so smaller CTAs need more K splits to keep 16 warps an SM."""
_WARPS_TAKEN = (1, 2, 4)
MAX_TOKENS = 64  # 1..8 tokens: the NT = 1 build (one 8-column MMA tile); 9..NT1_MAX_TOKENS: the NT = 1 looping build
# (column groups of 8); above: the NT = 2 looping build (column groups of 16: two tiles at once)
NT1_MAX_TOKENS = 32
"""9..this many tokens run the NT = 1 build whose CTAs loop over column groups of 8 (the shared expert a CTA per
group: its weights read once a group), more the NT = 2 one (groups of 16, two MMA tiles at once). At NT = 2 FC2
takes 168 registers (3 CTAs an SM) and FC1 spills or does the same, while at 9-32 tokens almost every routed expert
has at most 8 tokens: a second MMA tile mostly idles. Measured on the H200 (whole op from CUDA graphs, same run,
benchmarks/RESULTS.md session 25) against the NT = 2 builds: T = 12 -2.3%, 16 -3.4%, 20 -3.8%, 24 -5.2%, 32 -2%;
T = 9 +1.3 to +2.8% (its experts alone 3% faster, but the NT = 2 build's PDL overlapped the shared expert with
routing), 40 +1.8%, 48 +1.9%, 64 +7% (most experts then have more than 8 tokens: two passes over their weights)."""
ROUTE_MAX_TOKENS = 64  # route_stage: NT = 1, 2 or 8 (its staging for 8, 16 or 64 tokens: route_nt)
EARLY_LOAD: frozenset[tuple[int, bool]] = frozenset({(1, True)})
"""The decode builds (:func:`decode_build`'s (NT, looping) pairs) whose FC1 / FC2 warps issue their first
super-chunk's weight loads before their CTA stages the tokens, so the weight stream's first latency overlaps the
staging instead of following it (define ``EARLY``; the output is bitwise the same: only independent loads move; in
FC2 launched programmatically, ptxas keeps the shared expert's loads before ``grid_wait()`` but hoists the wait
above the routed experts'). With :data:`NATURAL` (off) the looping build's FC2 spills 23 words instead of 6
(offline sm_90a; untimed). Measured on the H200 (session 26, same run, two alternations, whole op): the
NT = 1 looping build (T = 9..32) at T = 16 2.6% faster (277.0 / 276.9 -> 269.8 / 270.1 us); the plain NT = 1 build
slower at T = 1 (63.2 / 66.0 -> 66.7 / 67.0) and T = 4 (+1%), so it stays off there."""
DECODE = 0  # 0: E2M1 -> f16 high byte by prmt; 1: -> E4M3 by prmt, then cvt.f16x2.e4m3x2; 2: loads only (a probe)
PTXAS_OPT = 3
"""ptxas's optimization level for the decode builds (``CudaKernelSpec.ptxas_opt``). At -O3 ptxas places the next
super-chunk's weight loads after ~15-24 of a step's 32 MMAs (its latency model), whatever their source order; at -O1
it leaves them at the top of each step, where the source puts them (every build, offline sm_90a, no spills, ~2% more
instructions in the NVFP4 loop). The same instructions otherwise: bitwise the same output. Measured on the H200
(session 38, same run, two alternations, whole op): -O1 is 8-11% slower at T = 1..8 and 1% faster at T = 16, so
-O3 stays (the loads' issue point is not what bounds the decode; benchmarks/RESULTS.md, session 38)."""
NATURAL = False
"""Read the routed NVFP4 experts in the checkpoint's own layout (``Nvfp4NaturalStream``) instead of the prepacked
copy. Since session 16 the wgmma prefill (:mod:`m3c.backends.kernels.moe_prefill_cuda`) reads the prepacked copy too,
so on sm_90 NATURAL would not save it (it saves it where only the decode kernels run).
Written without a GPU (CPU: the lane-level twin, the offline build): off until its GPU tests and a same-run timing
against the prepacked stream have run (prediction: ~0.6 more SASS instructions a weight, 0-10% slower at T = 1)."""
FOLD_ACT = True
"""No ``moe_act`` launch (define ``FOLD_ACT``) where the call folds (:func:`decode_folds`): FC1's CTAs count their
arrivals per act chunk (the gate and the up row block of 32 WARPS columns, every K split) at a counter the kernel
leaves at zero; the last to arrive sums the chunk's splits and writes SiLU(gate) * up for its pairs unscaled
(bf16 / float32 as the tokens), and each FC2 CTA stages its columns from those rows, finding each row's f16 scale
from the whole row itself. Bitwise the launch's output (same sums, same scale)."""
FOLD_COMBINE = True
"""No ``moe_combine`` launch (define ``FOLD_COMBINE``) where the call folds (:func:`decode_folds`): every FC2 CTA of
a row block (each routed slot's, used or not, and each shared split's and column group's) arrives at the block's
counter, which the kernel leaves at zero; the last to arrive sums the block's columns of the output for every token
as the launch does (same order: bitwise its output)."""
SMS = HOPPER.compute_units
"""SMs a wave is counted over (the hopper target's: an H200's or an H100 SXM's 132; :func:`one_wave`; the compile
and the launch must agree on it, so it is the target's, not the device's: on a part with fewer SMs a folded call
runs in more than one wave, correctly but slower). A call folds (:data:`FOLD_ACT`,
:data:`FOLD_COMBINE`) when FC1's and FC2's grids each fit one wave. Each folded CTA ends in a barrier and a release
atomic, which waits for its stores to reach L2; in one wave nothing waits for its slot, but where CTAs queue for
slots every wave pays it. Measured on the H200 with the folds forced at every T (same run, two alternations, whole
op from CUDA graphs, benchmarks/RESULTS.md session 31): T = 1 (480 CTAs each) 61.5 / 61.4 -> 60.1 / 60.2 us (act
alone -0.6, combine alone -0.8), T = 4 112.1 -> 125.8 (both) / 117.8 (act) / 118.3 (combine), T = 16 255.6 -> 310.1,
T = 64 507.4 -> 734.6. As chosen (folded at T = 1 only): T = 1 61.6 / 61.6 -> 60.5 / 60.4 us, T = 4 unchanged
(112.9-113.1)."""
SM_SHARED_BYTES = HOPPER.smem_per_sm  # shared memory an SM holds (228 KB), of which each resident CTA takes 1 KB
_STATIC_SMEM = 3072  # FC1's / FC2's static shared memory, rounded up (offline sm_90a: 2.3 KB at NT = 1, 3.0 at NT = 2)
BALANCE_SHARED = True
"""Where FC1's grid is one wave (:func:`one_wave`), split the shared expert's FC1 rows 3x as often as the routed
ones instead of 2x if the grid still fits (:func:`call_splits`): at T = 1 (8 experts, m3.1-small) 480 CTAs become
528, one per slot of an H200, where 480 left 84 SMs with four long CTAs and 48 with three. Measured (experts alone,
CUDA graphs, same runs, benchmarks/RESULTS.md session 31): T = 1 56.9 / 56.6 / 56.7 / 56.7 -> 55.1 / 55.2 / 55.1 /
55.3 us; at T = 2, 4 and 24 (grids of several waves) the same split was 0.3-3 us slower, so it stays one-wave only.
Splitting FC2's shared rows 3x too (528 FC2 CTAs) was slower at T = 1 (+1 to +2.6 us)."""

PREFETCH_FC2 = 0
"""n > 0: where the call folds (FC1's and FC2's grids one wave each: :func:`decode_folds`; one column group), each
FC1 CTA asks L2 (``prefetch.global.L2``) for the first n super-chunks (codes and scales of each warp's tiles) of
the FC2 items it stands for (define ``PREFETCH_FC2``), once its GEMV is done. HBM then reads them while FC1's last
CTAs finish, FC2 launches and stages, when it would idle, and FC2's first loads hit L2; the output is bitwise the
same. At T = 1 of m3.1-small an FC2 item reads 6 super-chunks; n = 2 asks for ~17 of FC2's 52 MB (~4 µs of HBM).
Timed on the H200 (session 33, same run, three alternations, whole op from CUDA graphs, bitwise the same output):
T = 1 n = 0 59.1 / 59.2 / 59.1 µs, n = 1 60.0 / 59.6 / 59.8, n = 2 60.0 / 60.2 / 60.2, n = 3 60.6 / 60.8 / 60.6;
T = 2 (not folded: the control) all 86.9-87.4. Predicted -1.5 to -3 µs: wrong sign, so it stays off. The CTA
timeline (``benchmarks/bench_moe_cta_timeline.py``) says why: FC1's tail is its routed CTAs still streaming at 3.5
TB/s after the shared expert's finish, so the prefetches compete with them (benchmarks/RESULTS.md session 33)."""

ACQUIRE_LAST = False
"""The folds' arrival counters (:data:`FOLD_ACT`'s act chunks, :data:`FOLD_COMBINE`'s row blocks): every arriving
CTA's atomic is a release only, and the last CTA of a counter alone fences to acquire (define ``ACQUIRE_LAST``),
instead of an acq_rel atomic in every CTA. Each acquire invalidates the SM's L1 (SASS ``CCTL.IVALL``); at T = 1
that is 1,008 invalidations landing under the other CTAs' weight streams, ~200 with this. Same output (bitwise).
Timed on the H200 (session 34, same run, two alternations, whole op from CUDA graphs): T = 1 59.1 / 58.8 ->
59.5 / 59.5 µs (with QUEUE 72.4 / 72.5 -> 73.0 / 73.1): the invalidations cost nothing measurable, so it stays off."""

QUEUE = False
"""Where the call folds (:func:`decode_folds`; one column group), run FC1 and FC2 as ONE persistent launch,
``moe_experts`` (define ``QUEUE``, ``cuda/moe_decode_queue.cuh``): as many CTAs as are resident claim items, FC1's
from two pools (the shared expert's and the routed experts', each CTA's first claim of its block's kind in
``moe_fc1``'s grid, so every SM gets that grid's mix), then FC2's from a ticket counter; an FC2 item waits only for
its own expert's act chunks (per-expert readiness counters), not for the whole of FC1. Deadlock-free without a
cooperative launch (FC2 tickets only once both pools are seen empty; FC1 items wait on nothing); the counters are
left at zero (graph replays). Why: the CTA timeline put 16 µs of T = 1's 59 in ramps and drains inside FC1 and FC2.
Measured on the H200 (session 34, same run, whole op from CUDA graphs, bitwise the fold's output): with one ticket
counter for all items 72.5 µs against 58.8 (some SMs drew four 221 KB items, others four 135 KB ones, and an SM
streams at most ~1/132 of HBM); with the pools 70.5 against 58.9: the shared FC2 items stream beside the routed
FC1 ones, which end later, and routed FC2 (its expert's whole FC1 first) is left with 384 streams, ~2.9 an SM at
~7.4 GB/s each (2.9 TB/s, where ``moe_fc2``'s 480 make 3.9; benchmarks/RESULTS.md session 34). Off."""
_STATIC_SMEM_QUEUE = 4096  # moe_experts' static shared memory (FC1's and FC2's both), rounded up (offline: 1.6 KB)

TIMELINE = False
"""A benchmark probe (``benchmarks/bench_moe_cta_timeline.py``): FC1 and FC2 stamp each CTA's %globaltimer at entry,
before its staging, after its GEMV's stores and at exit, with its SM, expert, K split and K range (define
``TIMELINE``), into int64 [grid, 8] tensors left in :data:`last_timeline` (FC1's, FC2's) by each call."""
last_timeline: list[torch.Tensor] = []
TIMELINE_AT = 0
"""Where :data:`TIMELINE` stamps its second word (define ``TL_AT``): 0 before the staging, 1 after FC1's routed
items' wait (FC2: at entry), 2 after finding the item's expert; so the time before the staging splits into parts."""

PDL_KERNELS = ("moe_fc1", "moe_act", "moe_fc2", "moe_combine")
PDL: dict[int | str, tuple[str, ...]] = {1: ("moe_fc1", "moe_fc2"), 2: PDL_KERNELS, "fold": ()}
"""Per NT (and "fold": the builds of calls that fold, :func:`decode_folds`; absent: their NT's), the kernels launched
as programmatic dependent launches (``CudaKernelSpec.pdl``; any of :data:`PDL_KERNELS`): each starts while its
predecessor runs, FC1's shared-expert items run their whole GEMV during the routing launch (module docstring, launch
2), FC2 finds its expert and asks L2 for its first weights during act. Measured on the H200 (whole op from CUDA
graphs, same run, two alternations, benchmarks/RESULTS.md session 33), none -> FC1 + FC2 at NT = 1: T = 2 89.9 /
89.7 -> 88.8 / 89.0 us, 4 113.0 / 113.1 -> 110.7 / 110.9, 8 168.4 / 167.2 -> 164.1 / 164.4, 16 261.3 / 261.1 -> 257.7
/ 258.7, 32 378.6 / 378.8 -> 371.7 / 371.9; but the folded T = 1 59.1 / 59.0 -> 60.9 / 60.9 (FC1 alone 60.2 / 60.3,
FC2 alone 59.3 / 59.2), so folded calls launch nothing programmatically. Act and combine stay plain at NT = 1: their
programmatic edges cost ~2 us each (session 26)."""
FC1_MIN_CTAS: dict[int | str, int] = {2: 4, "wide": 0}
"""Per build (NT, or "wide" for the looping builds), FC1 CTAs of 4 warps an SM the compiler must fit
(``__launch_bounds__`` minimum, scaled to 4 / WARPS as many CTAs of another size; 0: the compiler's choice; at NT = 1
the launch bounds already ask for 4). Left to itself it takes 167 registers at NT = 2, i.e. 3 CTAs an SM. Forcing 4
in the plain NT = 2 build (no longer chosen since session 25, kept for benchmarks: 128 registers, 3 spilled words)
made FC1 10.5% faster at T = 16, 8.6% at T = 12, 7.5% at T = 9 (same run, bitwise the same output;
benchmarks/RESULTS.md session 18). The NT = 2 looping build spills 18 words at 4 (168 registers and none at its own
choice): its own choice measured 4% faster at T = 64, 3% at T = 32, the same at T = 24 (session 23, when it ran
17..64 tokens)."""


def _rows_per_cta() -> int:
    """Weight rows an FC1 / FC2 CTA covers (:data:`WARPS` at call time)."""
    return 32 * WARPS


_TAG_CODES, _TAG_SCALES = "mma prepack codes", "mma prepack scales"  # derived() tags of the prepacked copies


def _splits(hidden: int, shared_inter: int, nt: int) -> tuple[int, int, int]:
    """(FC1 routed, FC1 shared, FC2 shared) K splits: more, shorter streams where K allows (each split a whole number
    of super-chunks; 2 NT when H allows, so FC1 stages at most 8 x H / 2 f16 values); the shared expert's MXFP8 rows
    hold twice the bytes, so it gets twice the splits."""
    ks1 = next(k for k in (2 * nt, nt, 1) if hidden % (256 * k) == 0)
    ks2s = 2 if shared_inter % 256 == 0 else 1
    return ks1, 2 * ks1, ks2s  # H / (2 ks1) is a multiple of 128: whole MXFP8 super-chunks


def _nt(tokens: int) -> int:
    """8-token MMA column tiles a CTA runs at once for T tokens (:data:`NT1_MAX_TOKENS`)."""
    return 1 if tokens <= NT1_MAX_TOKENS else 2


def _cta_too_small(tmax: int) -> str | None:
    """Why a build for `tmax` tokens cannot run in CTAs of :data:`WARPS` warps (find_tokens compacts 32 tokens a
    warp), or None."""
    return f"WARPS = {WARPS} compacts {32 * WARPS} tokens, the build takes {tmax}" if tmax > 32 * WARPS else None


def _wide(tokens: int) -> bool:
    """Whether T tokens need a looping ("wide") build: more than 8, so its CTAs loop over column groups of 8 NT."""
    return tokens > 8


def _tmax(nt: int, wide: bool) -> int:
    """Tokens the build of NT (looping or not) takes: 8 NT, or the most that :func:`_nt` gives that NT."""
    if not 8 <= NT1_MAX_TOKENS <= MAX_TOKENS:
        raise ConfigError(f"moe_cuda: NT1_MAX_TOKENS = {NT1_MAX_TOKENS}: must be 8..{MAX_TOKENS}")
    return (NT1_MAX_TOKENS if nt == 1 else MAX_TOKENS) if wide else 8 * nt


def decode_build(tokens: int) -> tuple[int, bool]:
    """(NT, looping) of the decode build :func:`moe_decode_mma` runs for T tokens (:func:`mma_specs`' arguments)."""
    return _nt(tokens), _wide(tokens)


def _first_tokens(choice: Callable[[int], Any], most: int) -> tuple[int, ...]:
    """The token counts 1..most where `choice` (T -> build) picks another build than for T - 1: one per build."""
    return tuple(t for t in range(1, most + 1) if t == 1 or choice(t) != choice(t - 1))


def mma_supported(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                  w13_fmt: str, shared_fmt: str | None, tokens: int) -> str | None:
    """None if the CUDA decode kernels take this layout and token count, else the reason."""
    if w13_fmt != "nvfp4":
        return f"routed experts are {w13_fmt}: the CUDA decode kernels take NVFP4"
    if shared_fmt not in (None, "none", "mxfp8"):
        return f"shared expert is {shared_fmt}: the CUDA decode kernels take MXFP8 or none"
    if act_dtype not in ("bf16", "fp32"):
        return f"activations are {act_dtype}: bf16 or float32 only"
    if not 1 <= tokens <= MAX_TOKENS:
        return f"T = {tokens}: the CUDA decode kernels take 1..{MAX_TOKENS} tokens"
    why = _cta_too_small(_tmax(*decode_build(tokens)))
    if why:
        return f"T = {tokens}: {why}"
    if experts > 1024 or top_k > 64:
        return f"{experts} experts, top-{top_k}: at most 1024 experts and top-64"
    rows = _rows_per_cta()
    if hidden % 256 or inter % 256 or hidden % rows or (2 * inter) % rows:
        return f"H = {hidden}, I = {inter}: both must be multiples of 256 (and H, 2I of {rows})"
    if shared_fmt == "mxfp8" and (shared_inter % 128 or (2 * shared_inter) % rows):
        return f"shared I = {shared_inter}: must be a multiple of 128"
    if hidden > 16384 or max(inter, shared_inter) > 4096:
        return f"H = {hidden}, I = {inter}, S = {shared_inter}: at most 16384 / 4096 / 4096 (staging buffers)"
    nt = _nt(tokens)
    smem = max(_fc1_smem(hidden, shared_inter, nt), _fc2_smem(inter, shared_inter, nt))
    if smem > SMEM_LIMIT:
        return (f"H = {hidden}, T = {tokens}: the staged tokens need {smem} bytes of shared memory, more than "
                f"{SMEM_LIMIT} (H / 256 odd leaves FC1 one K split)")
    return None


def call_support(x: torch.Tensor, w13: Any, shared_w13: Any, top_k: int) -> str | None:
    """:func:`mma_supported` for the tensors of one call (tokens x [T, H], routed w13, shared w13 or None)."""
    fmt = "nvfp4" if isinstance(w13, NVFP4Tensor) else type(w13).__name__
    sfmt = "none" if shared_w13 is None else "mxfp8" if isinstance(shared_w13, MXFP8Tensor) else \
        type(shared_w13).__name__
    if fmt != "nvfp4" or sfmt not in ("none", "mxfp8"):
        return mma_supported(0, 0, 0, top_k, 0, "bf16", fmt, sfmt, x.shape[0])
    e, two_i, hidden = w13.shape
    s = shared_w13.shape[0] // 2 if shared_w13 is not None else 0
    act = "bf16" if x.dtype == torch.bfloat16 else "fp32" if x.dtype == torch.float32 else str(x.dtype)
    return mma_supported(hidden, two_i // 2, e, top_k, s, act, fmt, sfmt, x.shape[0])


SMEM_LIMIT = 227 * 1024 - 2048  # the H200's opt-in shared memory per CTA, less the kernels' static arrays


def _fc1_smem(hidden: int, shared_inter: int, nt: int) -> int:
    return 8 * nt * (hidden // _splits(hidden, shared_inter, nt)[0] + 4) * 2


def _fc2_smem(inter: int, shared_inter: int, nt: int) -> int:
    return 8 * nt * (max(inter, shared_inter) + 4) * 2


def _grids(tokens: int, hidden: int, inter: int, experts: int, top_k: int, shared_inter: int,
           splits: tuple[int, int, int]) -> tuple[int, int]:
    nt, (ks1, ks1s, ks2s) = _nt(tokens), splits
    n_slots, rows = min(experts, tokens * top_k), _rows_per_cta()
    groups = -(-tokens // (8 * nt))  # the shared expert's column groups (a CTA each)
    fc1 = n_slots * 2 * inter // rows * ks1 + 2 * shared_inter // rows * ks1s * groups
    fc2 = n_slots * hidden // rows + (hidden // rows * ks2s * groups if shared_inter else 0)
    return fc1, fc2


def one_wave(tokens: int, hidden: int, inter: int, shared_inter: int) -> tuple[int, int]:
    """(FC1, FC2) CTAs resident at once on :data:`SMS` SMs for T tokens' build: registers (NT = 1: the launch
    bounds' 16 warps an SM; NT = 2 (the looping build): 168 registers, 12 warps, FC2 with :data:`NATURAL` 211, 8
    warps; offline sm_90a) and shared memory (each kernel's dynamic bytes + static + the 1 KB an SM keeps a CTA),
    the fewer of the two."""
    nt = _nt(tokens)

    def fits(kernel: str, dynamic: int) -> int:
        return _resident(16 if nt == 1 else 8 if kernel == "moe_fc2" and NATURAL else 12, dynamic + _STATIC_SMEM)
    return fits("moe_fc1", _fc1_smem(hidden, shared_inter, nt)), fits("moe_fc2", _fc2_smem(inter, shared_inter, nt))


def _resident(warps: int, smem: int) -> int:
    """CTAs of :data:`WARPS` warps resident at once on :data:`SMS` SMs when the registers allow `warps` warps an SM
    and each CTA takes `smem` bytes of shared memory (dynamic + static; the SM keeps 1 KB more a CTA)."""
    return SMS * min(warps // WARPS, SM_SHARED_BYTES // (smem + 1024))


def call_splits(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                shared_inter: int) -> tuple[int, int, int]:
    """(FC1 routed, FC1 shared, FC2 shared) K splits :func:`moe_decode_mma` uses for T tokens and this layout:
    :func:`_splits`', except that with :data:`BALANCE_SHARED` an FC1 grid of one wave takes the shared expert in 3x
    the routed splits (3 or 6) instead of 2x where that still fits the wave and fills it more."""
    ks1, ks1s, ks2s = _splits(hidden, shared_inter, _nt(tokens))
    wider = 3 * ks1
    if BALANCE_SHARED and shared_inter and wider in (3, 6) and hidden % (128 * wider) == 0:
        grid = _grids(tokens, hidden, inter, experts, top_k, shared_inter, (ks1, wider, ks2s))[0]
        if grid <= one_wave(tokens, hidden, inter, shared_inter)[0]:
            ks1s = wider
    return ks1, ks1s, ks2s


def decode_grids(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                 shared_inter: int) -> tuple[int, int]:
    """(FC1, FC2) grid sizes :func:`moe_decode_mma` launches for T tokens and this layout (shared_inter 0: no shared
    expert)."""
    splits = call_splits(tokens, hidden, inter, experts, top_k, shared_inter)
    return _grids(tokens, hidden, inter, experts, top_k, shared_inter, splits)


def decode_folds(tokens: int, hidden: int, inter: int, experts: int, top_k: int, shared_inter: int) -> bool:
    """Whether :func:`moe_decode_mma` folds the act / combine launches for T tokens and this layout: FC1's and FC2's
    grids each within one wave (:func:`one_wave`; and :data:`FOLD_ACT` or :data:`FOLD_COMBINE` on)."""
    grids = decode_grids(tokens, hidden, inter, experts, top_k, shared_inter)
    waves = one_wave(tokens, hidden, inter, shared_inter)
    return (FOLD_ACT or FOLD_COMBINE) and grids[0] <= waves[0] and grids[1] <= waves[1]


def call_build(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
               shared_inter: int) -> tuple[int, bool, bool]:
    """(NT, looping, folded): the build :func:`moe_decode_mma` runs for T tokens of this layout (:func:`mma_specs`'
    arguments; shared_inter 0: no shared expert)."""
    return (*decode_build(tokens), decode_folds(tokens, hidden, inter, experts, top_k, shared_inter))


def mma_specs(hidden: int, inter: int, shared_inter: int, act: str, nt: int = 1, wide: bool = False,
              fold: bool = False) -> tuple[CudaKernelSpec, ...]:
    """(stage_x, fc1, act, fc2, combine) CudaKernelSpecs for this layout and NT (shared memory for 8 NT tokens; no act
    with ``fold`` and :data:`FOLD_ACT`, no combine with ``fold`` and :data:`FOLD_COMBINE`);
    ``wide``: the looping build of NT (its CTAs loop over column groups of 8 NT; NT = 1 up to
    :data:`NT1_MAX_TOKENS` tokens, NT = 2 up to :data:`MAX_TOKENS`), else the build for 8 NT; ``fold``: the build
    for calls that fold (:func:`decode_folds`), with :data:`QUEUE` (stage_x, experts): FC1 and FC2 in one launch."""
    tmax = _tmax(nt, wide)
    if WARPS not in _WARPS_TAKEN:
        raise ConfigError(f"moe_cuda: WARPS = {WARPS}: the decode kernels take {_WARPS_TAKEN}")
    why = _cta_too_small(tmax)
    if why:
        raise ConfigError(f"moe_cuda: {why}")
    min_ctas = FC1_MIN_CTAS.get("wide" if wide else nt, 0) * 4 // WARPS  # counted in CTAs of 4 warps
    pdl = PDL.get("fold", PDL.get(nt, ())) if fold else PDL.get(nt, ())
    return _mma_specs(hidden, inter, shared_inter, act, nt, WARPS, DECODE, NATURAL, tuple(pdl),
                      min_ctas, tmax, (nt, wide) in EARLY_LOAD, fold and FOLD_ACT, fold and FOLD_COMBINE,
                      PREFETCH_FC2 if fold and not wide else 0, TIMELINE,
                      QUEUE and fold and not wide and FOLD_ACT and FOLD_COMBINE and not PREFETCH_FC2,
                      ACQUIRE_LAST and fold, TIMELINE_AT if TIMELINE else 0, PTXAS_OPT)


@functools.cache
def _mma_specs(hidden: int, inter: int, shared_inter: int, act: str, nt: int, warps: int, decode: int,
               natural: bool = False, pdl: tuple[str, ...] = (), fc1_min_ctas: int = 0, tmax: int = 0,
               early: bool = False, fold_act: bool = False, fold_combine: bool = False,
               prefetch: int = 0, timeline: bool = False, queue: bool = False,
               acquire_last: bool = False, timeline_at: int = 0, ptxas_opt: int = 3) -> tuple[CudaKernelSpec, ...]:
    d = (("WARPS", warps), ("NT", nt), ("ACT_BF16", int(act == "bf16")), ("DECODE", decode),
         *((("NATURAL", 1),) if natural else ()), *((("FC1_MIN_CTAS", fc1_min_ctas),) if fc1_min_ctas else ()),
         *((("TMAX", tmax),) if tmax > 8 * nt else ()), *((("EARLY", 1),) if early else ()),
         *((("FOLD_ACT", 1),) if fold_act else ()), *((("FOLD_COMBINE", 1),) if fold_combine else ()),
         *((("PREFETCH_FC2", prefetch),) if prefetch else ()), *((("TIMELINE", 1),) if timeline else ()),
         *((("QUEUE", 1),) if queue else ()), *((("ACQUIRE_LAST", 1),) if acquire_last else ()),
         *((("TL_AT", timeline_at),) if timeline_at else ()))
    tl = " *tl" if timeline else ""

    def spec(kernel: str, args: str, nwarps: int = warps, smem: int = 0) -> CudaKernelSpec:
        return CudaKernelSpec("megamoe_mma", SOURCE, kernel, arg_types(args), d, nwarps, smem, kernel in pdl,
                              ptxas_opt)

    fc1_args = ("*x *x16 *xmult T *ids topk E n_slots *rcode *rscale *rrow rows *scode *sscale srows H KSr KSs *h P "
                "ROWS" + (" *act *counters" if fold_act else "")
                + (" *rcode2 *rscale2 *scode2 *sscale2 KS2s" if prefetch else ""))
    smem1, smem2 = _fc1_smem(hidden, shared_inter, nt), _fc2_smem(inter, shared_inter, nt)
    if queue:  # FC1's arguments, then FC2's own (its weights renamed), then the ticket / readiness counters
        return spec("moe_stage_x", "*x H *x16 *xmult", 8), spec(
            "moe_experts", fc1_args + " *wts *rcode2 *rscale2 *rrow2 *scode2 *sscale2 I S KS2s *y *out *done *queue n1 "
            "n2" + tl, warps, max(smem1, smem2))
    fc1 = spec("moe_fc1", fc1_args + tl, warps, smem1)
    fc2 = spec("moe_fc2", ("*act" if fold_act else "*act16 *amult") + " T *ids *wts topk E n_slots *rcode *rscale *rrow "
               "*scode *sscale I S H KSs P ROWS *y" + (" *out *done" if fold_combine else "") + tl, warps, smem2)
    return (spec("moe_stage_x", "*x H *x16 *xmult", 8), fc1,
            *(() if fold_act else (spec("moe_act", "*h routed_pairs KSr KSs P ROWS I S *act16 *amult", 16),)),
            fc2, *(() if fold_combine else (spec("moe_combine", "*y *ids E T topk KSs P H *out", 8),)))


def route_supported(hidden: int, experts: int, top_k: int, act_dtype: str, tokens: int) -> str | None:
    """None if :func:`route_stage` takes this router layout and token count, else the reason."""
    if act_dtype not in ("bf16", "fp32"):
        return f"activations are {act_dtype}: bf16 or float32 only"
    if not 1 <= tokens <= ROUTE_MAX_TOKENS:
        return f"T = {tokens}: the routing kernel takes 1..{ROUTE_MAX_TOKENS} tokens"
    if not 1 <= experts <= ROUTE_MAX_EXPERTS or not 1 <= top_k <= min(experts, ROUTE_MAX_TOPK):
        return (f"{experts} experts, top-{top_k}: the routing kernel takes at most {ROUTE_MAX_EXPERTS} experts "
                f"and top-{ROUTE_MAX_TOPK}")
    if hidden <= 0 or hidden % 128:
        return f"H = {hidden}: must be a multiple of 128"
    return None


def route_nt(tokens: int) -> int:
    """The routing kernel's build for T tokens: the smallest of NT = 1, 2, 8 with 8 NT >= T (its staging and logits
    buffers hold 8 NT tokens)."""
    return 1 if tokens <= 8 else 2 if tokens <= 16 else 8


ROUTE_BUILD_TOKENS = _first_tokens(route_nt, ROUTE_MAX_TOKENS)  # one T for each of route_nt's builds (lowering)


def route_split(hidden: int, experts: int) -> tuple[int, int]:
    """(CH, KSPLIT): float4 K chunks per lane and K slices of the router GEMV, from the layout alone (so the logits'
    summation order, hence the routing, is the same on every device): the shortest slices (most CTAs) keeping
    ceil(E / 8) x KSPLIT within ``_ROUTE_CTAS``; a slice is 128 CH of the H values."""
    chunks, groups = hidden // 128, -(-experts // 8)
    ch = next(d for d in range(1, chunks + 1) if chunks % d == 0 and groups * (chunks // d) <= _ROUTE_CTAS)
    return ch, chunks // ch


def route_stage_spec(hidden: int, experts: int, act: str, nt: int) -> CudaKernelSpec:
    """The CudaKernelSpec of ``moe_route_stage`` (:func:`route_stage`) for this router layout and NT."""
    return _route_stage_spec(hidden, experts, act, nt)


@functools.cache
def _route_stage_spec(hidden: int, experts: int, act: str, nt: int) -> CudaKernelSpec:
    ch, ksplit = route_split(hidden, experts)
    eslots = -(-experts // 32)
    d = (("NT", nt), ("ACT_BF16", int(act == "bf16")), ("CH", ch), ("KSPLIT", ksplit), ("ESLOTS", eslots))
    p, i = "*u8", "i32"
    types = (("x", p), ("gate", p), ("bias", p), ("T", i), ("H", i), ("E", i), ("topk", i), ("scale", "fp32"),
             ("norm", i), ("ids", p), ("wts", p), ("logits", p), ("x16", p), ("xmult", p), ("part", p),
             ("counter", p))
    logits = 8 * nt * 32 * eslots * 4  # the merged logits in dynamic shared memory: 64 KB at most (64 x 256 floats)
    return CudaKernelSpec("megamoe_route", ROUTE_SOURCE, "moe_route_stage", types, d, 8, logits)


def _route_workspace(device: torch.device, experts: int, ksplit: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(partial sums [64 E KSPLIT], a zeroed int32 counter, logits scratch [64 E]: ROUTE_MAX_TOKENS tokens) kept per
    device and layout: the kernel leaves the counter at zero, so CUDA-graph replays need nothing reset."""
    return persistent(("moe_route_stage", str(device), experts, ksplit),
                      lambda: (torch.empty(ROUTE_MAX_TOKENS * experts * ksplit, dtype=torch.float32, device=device),
                               torch.zeros(1, dtype=torch.int32, device=device),
                               torch.empty(ROUTE_MAX_TOKENS * experts, dtype=torch.float32, device=device)))


def route_stage(x: torch.Tensor, gate_w32: torch.Tensor, bias: torch.Tensor, top_k: int,
                routed_scaling_factor: float, norm_topk_prob: bool, *, runner: Runner = jit_run,
                logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_ids int64 [T, k], topk_weights float32 [T, k], x16 f16 [T, H], xmult float32 [T]) for 1 <= T <= 64
    tokens in ONE launch (``moe_route_stage``, module docstring step 0): the router logits x @ gate_w32^T in
    float32, ``MoE.route``'s selection and weights, and the tokens staged for :func:`moe_decode_mma`.

    ``gate_w32`` float32 [E, H] (:func:`~m3c.backends.kernels.moe_routing.gate_weight`), ``bias`` float32 [E].
    The logits sum in the kernel's own fixed order (deterministic; not cuBLAS's), so ids can differ from the
    reference only where corrected scores tie within rounding; the weights' normalization sums in slot order (an ulp).
    NaN logits: as ``torch.sort``, NaN scores come first (ties to the smaller index), their weights NaN.
    ``logits`` (optional float32 [T, E], contiguous) receives the merged logits (for checks)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"route_stage: x {tuple(x.shape)} {x.dtype}: expected bf16 / float32 tokens [T, H]")
    if gate_w32.dim() != 2 or gate_w32.dtype != torch.float32 or gate_w32.shape[1] != x.shape[1]:
        raise ShapeError(f"route_stage: gate {tuple(gate_w32.shape)} {gate_w32.dtype}: expected float32 "
                         f"[E, {x.shape[1]}]")
    t, hidden = x.shape
    e = gate_w32.shape[0]
    if tuple(bias.shape) != (e,):
        raise ShapeError(f"route_stage: bias {tuple(bias.shape)}: expected ({e},)")
    act = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    why = route_supported(hidden, e, top_k, act, t)
    if why:
        raise ShapeError(f"route_stage: {why}")
    if logits is not None and (logits.shape != (t, e) or logits.dtype != torch.float32 or not logits.is_contiguous()):
        raise ShapeError(f"route_stage: logits {tuple(logits.shape)} {logits.dtype}: expected contiguous float32 "
                         f"[{t}, {e}]")
    dev = x.device
    spec = route_stage_spec(hidden, e, act, route_nt(t))
    ksplit = dict(spec.defines)["KSPLIT"]  # the compiled split (whatever route_split would say now)
    part, counter, scratch = _route_workspace(dev, e, ksplit)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    w = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    x16 = torch.empty((t, hidden), dtype=torch.float16, device=dev)
    xmult = torch.empty(t, dtype=torch.float32, device=dev)
    grid = (t + -(-e // 8) * ksplit,)  # T staging CTAs, then the GEMV CTAs
    runner(spec, grid,
           [_aligned(x.contiguous()), _aligned(gate_w32.contiguous()), bias.to(torch.float32).contiguous(), t,
            hidden, e, top_k, float(routed_scaling_factor), int(bool(norm_topk_prob)), ids, w,
            scratch if logits is None else logits, x16, xmult, part, counter])
    return ids, w, x16, xmult


def _aligned(v: torch.Tensor) -> torch.Tensor:
    """`v`, or a copy where its start is not 16-byte aligned (the kernel's vector loads)."""
    return v if v.device.type == "meta" or v.data_ptr() % 16 == 0 else v.clone()


_PREPACK_ROWS = 4096
"""Rows prepacked at a time: the int64 intermediates stay ~16x one chunk's code bytes, not the whole weight's."""


def prepack_nvfp4(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) uint8 in the kernel's NVFP4 layout (module docstring) from packed codes [..., N, K/2] and
    E4M3 scales [..., N, K/16] (N a multiple of 16, K of 256), built :data:`_PREPACK_ROWS` rows at a time (the layout
    is tile-major: each chunk of rows fills its own slice)."""
    rows = math.prod(data.shape[:-1])
    k = data.shape[-1] * 2
    if rows % 16 or k % 256 or tuple(scale.shape[:-1]) != tuple(data.shape[:-1]) or scale.shape[-1] * 16 != k:
        raise ShapeError(f"prepack_nvfp4: codes {tuple(data.shape)} / scales {tuple(scale.shape)} must be "
                         "[..., N, K/2] / [..., N, K/16] with N % 16 == 0 and K % 256 == 0")
    d2, s2 = data.reshape(rows, k // 2), scale.reshape(rows, k // 16)
    codes = torch.empty(rows * k // 2, dtype=torch.uint8, device=data.device)
    scales = torch.empty(rows * k // 16, dtype=torch.uint8, device=data.device)
    step = max(16, _PREPACK_ROWS // 16 * 16)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        c, sc = _prepack_nvfp4_rows(d2[r:r + n], s2[r:r + n], n, k)
        codes[r * k // 2:(r + n) * k // 2] = c
        scales[r * k // 16:(r + n) * k // 16] = sc
    return codes, scales


def _prepack_nvfp4_rows(data: torch.Tensor, scale: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    d = data.to(torch.int64)
    nib = torch.stack((d & 0xF, d >> 4), dim=-1).reshape(rows // 16, 2, 8, k // 256, 4, 4, 4, 4)
    x = nib.permute(0, 3, 4, 2, 5, 6, 1, 7)  # tile, sc, c, g, j, s, h, e
    a = x[..., 0:2].reshape(*x.shape[:-2], 4)  # byte i = (h, e) = (i // 2, i % 2)
    b = x[..., 2:4].reshape(*x.shape[:-2], 4)  # byte i = (i // 2, 2 + i % 2)
    i = torch.arange(4, device=data.device)
    word = (((a & 7) << (4 * i)) | ((b & 7) << (16 + 4 * i)) | ((a >> 3) << (8 * i + 7))
            | ((b >> 3) << (8 * i + 3))).sum(dim=-1)
    codes = word.to(torch.int64).bitwise_and(0xFFFFFFFF)
    codes = torch.where(codes >= 2**31, codes - 2**32, codes).to(torch.int32).contiguous().view(torch.uint8)
    s = scale.view(torch.uint8).reshape(rows // 16, 2, 8, k // 256, 4, 4)
    scales = s.permute(0, 3, 2, 5, 4, 1).contiguous()  # tile, sc, g, j, c, h
    return codes.reshape(-1), scales.reshape(-1)


def prepack_mxfp8(data: torch.Tensor) -> torch.Tensor:
    """uint8 codes in the kernel's MXFP8 layout (module docstring) from E4M3 codes [..., N, K] (N % 16, K % 128)."""
    rows = math.prod(data.shape[:-1])
    k = data.shape[-1]
    if rows % 16 or k % 128:
        raise ShapeError(f"prepack_mxfp8: codes {tuple(data.shape)} need N % 16 == 0 and K % 128 == 0")
    d = data.reshape(rows, k).view(torch.uint8).reshape(rows // 16, 2, 8, k // 128, 4, 2, 4, 2, 2)
    # tile, h, g, sc, u, qq, j, ew, e2  ->  tile, sc, u, g, j, qq, ew, h, e2
    return d.permute(0, 3, 4, 2, 6, 5, 7, 1, 8).contiguous().reshape(-1)


def moe_decode_mma(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: NVFP4Tensor,
                   w2: NVFP4Tensor, shared_w13: Any, shared_w2: Any, *, runner: Runner = jit_run,
                   out: torch.Tensor | None = None, x16: torch.Tensor | None = None,
                   xmult: torch.Tensor | None = None) -> torch.Tensor:
    """Routed NVFP4 experts (+ MXFP8 shared expert) for T <= 64 tokens: out [T, H] in x's dtype (bf16 / float32).

    ``topk_ids`` int64 / ``topk_weights`` float32 [T, k] (from :func:`~m3c.backends.kernels.moe_routing.fused_route`
    or ``MoE.route``), ``w13`` NVFP4 [E, 2I, H], ``w2`` NVFP4 [E, H, I], the shared pair MXFP8 ([2S, H], [H, S])
    or both None. Prepacked weights are built on first use and kept on the weight tensors (a second copy: the
    prefill kernels read the natural layout; with :data:`NATURAL` only the shared expert's), so the first call per
    weight must run outside CUDA-graph capture
    (:class:`CaptureError` otherwise; the runtime's graphs warm up first). Tokens whose routing produced an id
    outside [0, E) (NaN router logits) come out NaN. ``x16`` f16 [T, H] / ``xmult`` float32 [T]: the tokens already
    staged by :func:`route_stage`, launched just before (the ``moe_stage_x`` launch is skipped; with :data:`PDL`,
    FC1's shared-expert CTAs read x while that launch runs, which its plain launch makes safe)."""
    from m3c.backends.kernels.moe_prefill import nvfp4_row_scales, weight_args

    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"moe_decode_mma: x {tuple(x.shape)} {x.dtype}: expected bf16 / float32 tokens [T, H]")
    if (shared_w13 is None) != (shared_w2 is None):
        raise ShapeError("moe_decode_mma: pass both shared_w13 and shared_w2, or neither")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ShapeError(f"moe_decode_mma: out {tuple(out.shape)} {out.dtype} must be a contiguous {x.dtype} "
                         f"{tuple(x.shape)}")
    if (x16 is None) != (xmult is None):
        raise ShapeError("moe_decode_mma: pass both x16 and xmult, or neither")
    if x16 is not None and (x16.shape != x.shape or x16.dtype != torch.float16 or not x16.is_contiguous()
                            or tuple(xmult.shape) != (x.shape[0],) or xmult.dtype != torch.float32):
        raise ShapeError(f"moe_decode_mma: staged tokens x16 {tuple(x16.shape)} {x16.dtype} / xmult "
                         f"{tuple(xmult.shape)} {xmult.dtype}: expected contiguous f16 {tuple(x.shape)} / float32 "
                         f"[{x.shape[0]}]")
    why = call_support(x, w13, shared_w13, topk_ids.shape[1])
    if why:
        raise ShapeError(f"moe_decode_mma: {why}")
    t, hidden = x.shape
    e, two_i = w13.data.shape[0], w13.data.shape[1]
    inter, top_k = two_i // 2, topk_ids.shape[1]
    shared = shared_w13 is not None
    s = shared_w13.data.shape[0] // 2 if shared else 0
    act = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    nt, wide, folds = call_build(t, hidden, inter, e, top_k, s)
    ks1, ks1s, ks2s = call_splits(t, hidden, inter, e, top_k, s)
    if not {ks1, ks1s} <= {1, 2, 3, 4, 6, 8}:  # act sums FC1's splits by templates for these counts only
        raise ConfigError(f"moe_cuda: FC1 K splits {ks1} / {ks1s}: act takes 1, 2, 3, 4, 6 or 8")
    if ks1s < ks1:  # FC1's shared memory holds the routed split's K range (_fc1_smem)
        raise ConfigError(f"moe_cuda: FC1 K splits {ks1} / {ks1s}: the shared expert's must be at least the routed's")
    grid1, grid2 = decode_grids(t, hidden, inter, e, top_k, s)
    specs = {sp.kernel: sp for sp in mma_specs(hidden, inter, s, act, nt, wide, folds)}
    fold, fold_combine = "moe_act" not in specs, "moe_combine" not in specs
    queue = "moe_experts" in specs
    packed = (shared_w13, shared_w2) if NATURAL else (w13, w2, shared_w13, shared_w2)
    chm = max(inter, s) // _rows_per_cta()  # FOLD_ACT's act chunks an expert (counters a row of them)
    counters_key = ("moe_fc1 act counters", str(x.device), e, chm)
    done_key = ("moe_fc2 combine counters", str(x.device), hidden // _rows_per_cta())
    queue_key = ("moe_experts queue", str(x.device), e)
    if x.is_cuda and torch.cuda.is_current_stream_capturing() and not (
            is_prepacked(*packed) and (not fold or persistent_ready(counters_key))
            and (not fold_combine or persistent_ready(done_key)) and (not queue or persistent_ready(queue_key))):
        raise CaptureError("moe_decode_mma: the prepacked weights (and FC1's act counters) are built at the first "
                           "call, which must run outside CUDA-graph capture: call once eagerly (a warm-up) before "
                           "capturing")
    if NATURAL:  # read in place: the shapes, dtypes and 16-byte alignment the prefill kernels also need
        if DECODE:
            raise ConfigError("moe_cuda: NATURAL decodes the routed experts with decode8 (f16); set DECODE = 0")
        c13 = weight_args(w13, "nvfp4", (e, two_i, hidden), "moe_decode_mma w13")[:2]
        c2 = weight_args(w2, "nvfp4", (e, hidden, inter), "moe_decode_mma w2")[:2]
    else:
        c13, c2 = packed_pair(w13), packed_pair(w2)
    g13 = nvfp4_row_scales(w13, (e, two_i), "w13")
    g2 = nvfp4_row_scales(w2, (e, hidden), "w2")
    if shared:
        sc13 = derived(shared_w13.data, _TAG_CODES, lambda: prepack_mxfp8(shared_w13.data))
        sc2 = derived(shared_w2.data, _TAG_CODES, lambda: prepack_mxfp8(shared_w2.data))
        ss13, ss2 = shared_w13.scale.view(torch.uint8), shared_w2.scale.view(torch.uint8)
    else:
        sc13 = sc2 = ss13 = ss2 = c13[0]
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    n_slots = min(e, t * top_k)
    routed_pairs = t * top_k
    pairs = routed_pairs + (t if shared else 0)
    rows_ws = max(two_i, 2 * s)
    dev = x.device
    staged = x16 is not None
    if not staged:
        x16 = torch.empty((t, hidden), dtype=torch.float16, device=dev)
        xmult = torch.empty(t, dtype=torch.float32, device=dev)
    h = torch.empty((max(ks1, ks1s), pairs, rows_ws), dtype=torch.float32, device=dev)
    if fold:  # the act values, unscaled; a counter for each act chunk of each expert and shared column group
        act_v = torch.empty((pairs, rows_ws // 2), dtype=x.dtype, device=dev)
        counters = persistent(counters_key, lambda: torch.zeros((e + MAX_TOKENS // 8) * chm, dtype=torch.int32,
                                                                device=dev))
    else:
        act16 = torch.empty((pairs, rows_ws // 2), dtype=torch.float16, device=dev)
        amult = torch.empty(pairs, dtype=torch.float32, device=dev)
    y = torch.empty((ks2s, pairs, hidden), dtype=torch.float32, device=dev)
    out = torch.empty_like(x) if out is None else out
    xa = _aligned(x.contiguous())  # FC1's shared-expert items stage the tokens from x (16-byte vector loads)
    if not staged:
        runner(specs["moe_stage_x"], (t,), [xa, hidden, x16, xmult])
    rows = _rows_per_cta()
    timeline = "TIMELINE" in dict(specs["moe_stage_x"].defines)
    if timeline:  # (the probe: zeros where a CTA stamps nothing; moe_experts stamps FC1's items, then FC2's)
        tl = torch.zeros((grid1 + grid2, 8), dtype=torch.int64, device=dev)
        last_timeline[:] = [tl[:grid1], tl[grid1:]]
    tl1, tl2 = ([v] for v in last_timeline) if timeline else ([], [])
    done = persistent(done_key, lambda: torch.zeros(hidden // rows, dtype=torch.int32, device=dev)) \
        if fold_combine else None  # a counter per FC2 row block
    fc1_args = [xa, x16, xmult, t, ids, top_k, e, n_slots, c13[0], c13[1], g13, two_i, sc13, ss13, 2 * s, hidden, ks1,
                ks1s, h, pairs, rows_ws, *((act_v, counters) if fold else ())]  # (moe_experts' first arguments too)
    if queue:
        _launch_queue(specs["moe_experts"], runner, grid1, grid2, [
            *fc1_args, wts, c2[0], c2[1], g2, sc2, ss2, inter, s, ks2s, y, out, done,
            persistent(queue_key, lambda: torch.zeros(queue_ints(e), dtype=torch.int32, device=dev)),
            grid1, grid2, *([tl] if timeline else [])])
        return out
    prefetch = "PREFETCH_FC2" in dict(specs["moe_fc1"].defines)
    runner(specs["moe_fc1"], (grid1,), [*fc1_args, *((c2[0], c2[1], sc2, ss2, ks2s) if prefetch else ()), *tl1])
    if not fold:
        runner(specs["moe_act"], (pairs,), [h, routed_pairs, ks1, ks1s, pairs, rows_ws, inter, s, act16, amult])
    runner(specs["moe_fc2"], (grid2,), [*((act_v,) if fold else (act16, amult)), t, ids, wts, top_k, e, n_slots,
                                        c2[0], c2[1], g2, sc2, ss2, inter, s, hidden, ks2s, pairs, rows_ws, y,
                                        *((out, done) if fold_combine else ()), *tl2])
    if not fold_combine:
        runner(specs["moe_combine"], (triton.cdiv(hidden, 256), t),
               [y, ids, e, t, top_k, ks2s if shared else 0, pairs, hidden, out])
    return out


def queue_ints(experts: int) -> int:
    """Ints of ``moe_experts``' counters (:data:`QUEUE`): FC2's ticket counter, the shared and the routed experts'
    FC1 pools, then the act readiness and the FC2 consumption counters of each expert and the shared expert, each
    starting on its own 128-byte line."""
    return 96 + 2 * (-(-(experts + 1) // 32) * 32)


def _launch_queue(spec: CudaKernelSpec, runner: Runner, n1: int, n2: int, args: list) -> None:
    """Launch ``moe_experts`` (:data:`QUEUE`, `args` its arguments) over FC1's n1 and FC2's n2 items: as many CTAs
    as are resident at once on :data:`SMS` SMs (the NT = 1 launch bounds' 16 warps an SM, and shared memory), fewer
    if there are fewer items; the counters, not the grid, hand out the items, so a part with fewer SMs only runs
    them in a different order."""
    runner(spec, (max(1, min(n1 + n2, _resident(16, spec.shared_bytes + _STATIC_SMEM_QUEUE))),), args)


class CaptureError(M3CError, RuntimeError):
    """A launch that must build state first (prepacked weights) was called inside CUDA-graph capture."""


def is_prepacked(*weights: Any) -> bool:
    """Whether every weight's prepacked copy is already built (and current)."""
    for w in weights:
        if isinstance(w, NVFP4Tensor) and not (derived_ready(w.data, _TAG_CODES)
                                               and derived_ready(w.scale, _TAG_SCALES)):
            return False
        if isinstance(w, MXFP8Tensor) and not derived_ready(w.data, _TAG_CODES):
            return False
    return True


def packed_pair(w: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepacked (codes, scales) of an NVFP4 weight, built once per version of its codes and of its scales (the
    one copy the decode kernels here and the wgmma prefill of :mod:`m3c.backends.kernels.moe_prefill_cuda` read)."""
    both: list[tuple[torch.Tensor, torch.Tensor]] = []

    def make(i: int) -> torch.Tensor:
        if not both:
            both.append(prepack_nvfp4(w.data, w.scale))
        return both[0][i]
    return derived(w.data, _TAG_CODES, lambda: make(0)), derived(w.scale, _TAG_SCALES, lambda: make(1))
