"""The warp-specialized FC1 / FC2 (``moe_prefill_ws``; FC1 runs the fp8 prefill's routed tiles): their builds
(offline, sm_90a: SS wgmma m64n256k32 E4M3, mbarriers, bulk copies, spills per kernel), argument checks and grids,
the tokens' tile image, and on a GPU FC1's act against a float64 model of its own rounding (E4M3 weights x scale x
2^-wexp, E4M3 token rows, bf16 gate / up / SiLU / product) from NaN-poisoned outputs. FC2 is checked end to end in
test_moe_prefill_cuda.py."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from test_moe_prefill import _problem, _to
from test_moe_prefill_cuda import _bf16, _e4m3_rescaled, _e4m3_rows, _e4m3_weights, _swiglu_bf16

from m3c.backends.cuda_aot import SOURCE_DIR, compile_cuda, disassemble, find_nvcc
from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels import moe_prefill as mp
from m3c.backends.kernels import moe_prefill_cuda as pc
from m3c.backends.kernels import moe_prefill_ws as ws
from m3c.backends.triton_aot import jit_run
from m3c.errors import ConfigError, ShapeError
from m3c.model_defs import quant

# (A / B stages, raw stages, LUT, tokens by bulk copies, a CTA an SM looping over the items, the items tile-major)
BUILDS = [(3, 3, 0, 0, 0, 0), (3, 2, 0, 0, 0, 0), (2, 3, 0, 0, 0, 0), (3, 3, 1, 0, 0, 0), (3, 3, 1, 1, 0, 0),
          (2, 2, 0, 1, 0, 0), (3, 3, 1, 1, 1, 0), (2, 3, 0, 0, 1, 0), (3, 3, 1, 1, 1, 1), (3, 3, 0, 0, 0, 1)]
KNOBS = ("STAGES", "RAW", "LUT", "TBULK", "PERSIST", "TMAJOR")


def _function_sass(spec) -> str:
    """The SASS of the spec's kernel alone (the module holds FC1, FC2 and the image kernel)."""
    return disassemble(compile_cuda(spec, "sm_90a").binary).split(f"Function : {spec.kernel}")[1].split("Function :")[0]


def _set_build(monkeypatch: pytest.MonkeyPatch, build: tuple[int, ...]) -> None:
    for k, v in zip(KNOBS, build, strict=True):
        monkeypatch.setattr(ws, k, v if k in ("STAGES", "RAW") else bool(v))


@pytest.mark.parametrize("build", [b for b in BUILDS if not b[4]])  # (PERSIST changes the grid, not the code)
def test_builds_for_sm90a_with_smem_wgmma_and_mbarriers(build: tuple[int, ...],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _set_build(monkeypatch, build)
    stages, raw, _, tbulk, _, _ = build
    spec = ws.fc1_spec()
    assert spec.num_warps == 12 and spec.shared_bytes == ws.smem_bytes(stages, raw, bool(tbulk)) <= ws.smem_limit()
    assert ("MAXE", ws.MAX_EXPERTS) in spec.defines  # (the tile table's size: one constant for host and kernel)
    sass = _function_sass(spec)
    assert sass.count("QGMMA.64x256x32.F32.E4M3.E4M3") == 4  # one stage: 4 k32 steps, A and B from descriptors
    assert "SYNCS.PHASECHK" in sass and "SYNCS.ARRIVE" in sass  # mbarrier waits and arrivals
    assert "F2FP.SATFINITE.E4M3" in sass  # (LUT: in the table build)
    # TBULK: a routed stage's tokens by one bulk copy, a shared-expert stage's tokens and E4M3 weights by two
    assert sass.count("UBLKCP") == 3 * tbulk and "LDGSTS" in sass
    for k, v in zip(KNOBS[2:4] + KNOBS[5:], build[2:4] + build[5:], strict=True):
        assert ((k, 1) in spec.defines) == bool(v)
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([find_nvcc(), "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
                              *[f"-D{k}={v}" for k, v in spec.defines], "-o", str(Path(tmp) / "k.cubin"),
                              str(SOURCE_DIR / ws.SOURCE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "serializ" not in res.stderr, res.stderr[-2000:]
    # spills per kernel: none in the image kernel; FC1 and FC2 keep at most 4 words of their work-item state on the
    # stack (stored at an item's start, loaded after its tile search and at its end: outside the stage loops; SASS
    # read, sessions 28 and 29)
    spills = dict(re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores", res.stderr, re.S))
    assert spills.keys() == {"moe_ws_image", "moe_ws_fc1", "moe_ws_fc2"} and spills["moe_ws_image"] == "0"
    assert int(spills["moe_ws_fc1"]) <= 16 and int(spills["moe_ws_fc2"]) <= 16, res.stderr[-2000:]


def test_fc2_builds_for_sm90a_and_checks_its_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """FC2: the same SS wgmma loop with its A rows by one bulk copy a stage (a shared-expert stage's A and B by two;
    its spills: the build test); bad shapes and dtypes named; the grid a tile of 128 sorted pairs x 256 output rows,
    or at most a CTA an SM with PERSIST; the shared expert's items after the routed ones, or alone."""
    spec = ws.fc2_spec()
    assert spec.kernel == "moe_ws_fc2" and ("TBULK", 1) in spec.defines
    sass = _function_sass(spec)
    assert sass.count("QGMMA.64x256x32.F32.E4M3.E4M3") == 4 and sass.count("UBLKCP") == 3
    u8, i32 = torch.uint8, torch.int32
    t, k, e, h, i = 4, 2, 3, 512, 256
    p = t * k
    packed = torch.zeros(1, dtype=u8)
    args = [torch.zeros(p, i, dtype=u8), torch.zeros(p), torch.zeros(p, dtype=i32), torch.zeros(p),
            torch.tensor([0, 3, 3, 8], dtype=i32), packed, packed, torch.zeros(e, h),
            torch.zeros(t, k + 1, h, dtype=torch.bfloat16), torch.zeros(ws.max_tiles(p, e), 2 * 16384, dtype=u8)]
    calls: list = []
    assert ws.fc2(*args, top_k=k, wexp=1, runner=lambda *a: calls.append(a)) is args[8]
    [(sp, grid, launch)] = calls
    tiles = ws.max_tiles(p, e)
    assert sp is spec and grid == (2 * tiles,) and launch[14:] == [t, h, i, 0, e, k, k + 1, 1, tiles, 0]
    bad = list(args)
    bad[8] = torch.zeros(t, k - 1, h, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"y \[T, >= top_k, H\]"):
        ws.fc2(*bad, top_k=k, wexp=1)
    s = 384  # the shared expert's items: S / 128 = 3 stages, ceil(4 / 128) = 1 tile
    sh = (torch.zeros(1, s * 128, dtype=u8), torch.zeros(t), torch.zeros(h // 256, 3 * ws.B_BYTES, dtype=u8),
          torch.zeros(h))
    for routed in (True, False):
        calls.clear()
        ws.fc2(*args, top_k=k, wexp=1, shared=sh, routed=routed, runner=lambda *a: calls.append(a))
        [(_, grid, launch)] = calls
        n = tiles * routed
        assert grid == (2 * (n + 1),) and launch[10:14] == list(sh)
        assert launch[14:] == [t, h, i, s, e if routed else 0, k, k + 1, 1, n, 1]  # (alone: no tile table to build)
    for j, v in enumerate(sh):  # each shared tensor's shape and dtype checked
        bad_sh = list(sh)
        bad_sh[j] = v[..., :-1] if v.dim() == 2 else v[1:]
        with pytest.raises(ShapeError, match="the shared expert's w2 image must be"):
            ws.fc2(*args, top_k=k, wexp=1, shared=tuple(bad_sh))
        bad_sh[j] = v.double()
        with pytest.raises(ShapeError, match="must be a contiguous"):
            ws.fc2(*args, top_k=k, wexp=1, shared=tuple(bad_sh))
    bad = list(args)
    bad[8] = torch.zeros(t, k, h, dtype=torch.bfloat16)  # no slot for the shared expert
    with pytest.raises(ShapeError, match=r"> top_k with the shared expert"):
        ws.fc2(*bad, top_k=k, wexp=1, shared=sh)
    bad = list(args)
    bad[9] = args[9][1:]
    with pytest.raises(ShapeError, match=r"xt \[4, 32768\] \(token_image\)"):
        ws.fc2(*bad, top_k=k, wexp=1)
    bad = list(args)
    bad[3] = torch.zeros(p, dtype=torch.float64)
    with pytest.raises(ShapeError, match=r"wts must be a contiguous torch\.float32"):
        ws.fc2(*bad, top_k=k, wexp=1)
    monkeypatch.setattr(ws, "MAX_EXPERTS", e - 1)  # more experts than the tile table holds: the routed items refuse
    with pytest.raises(ShapeError, match=f"{e} experts: .*the routed experts at most {e - 1}"):
        ws.fc2(*args, top_k=k, wexp=1)
    calls.clear()  # (the shared items alone read no tile table)
    ws.fc2(*args, top_k=k, wexp=1, shared=sh, routed=False, runner=lambda *a: calls.append(a))
    assert len(calls) == 1
    monkeypatch.setattr(ws, "MAX_EXPERTS", 1024)
    calls.clear()
    monkeypatch.setattr(ws, "PERSIST", True)  # at most a CTA an SM (132 for a CPU tensor)
    ws.fc2(*args, top_k=k, wexp=1, runner=lambda *a: calls.append(a))
    assert calls[0][1] == (2 * tiles,) and ws.grid(1000, args[8].device) == (132,)


def _image_model(xq: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, k: int, shared: bool = False
                 ) -> torch.Tensor:
    """token_image by a loop over the sorted pairs: tile r's stage s holds K chunk kc of tile row n at 2048 kc + 16 n
    (the experts' tiles in expert order), zero elsewhere; `shared`: then xq's rows in order, from the routed tiles'
    bound on."""
    t, h = xq.shape
    bound = ws.max_tiles(order.numel(), offs.numel() - 1)
    want = torch.zeros(bound + shared * -(-t // ws.BT), h // 128, 8, ws.BT, 16, dtype=torch.uint8)
    tile = 0
    for ex in range(offs.numel() - 1):
        lo, hi = int(offs[ex]), int(offs[ex + 1])
        for p in range(lo, hi):
            want[tile + (p - lo) // ws.BT, :, :, (p - lo) % ws.BT] = xq[int(order[p]) // k].cpu().view(h // 128, 8, 16)
        tile += -(-(hi - lo) // ws.BT)
    for r in range(t if shared else 0):
        want[bound + r // ws.BT, :, :, r % ws.BT] = xq[r].cpu().view(h // 128, 8, 16)
    return want.view(want.shape[0], -1)


def _image_problem(rng: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    t, h, e, k = 150, 512, 6, 3
    xq = torch.randint(1, 256, (t, h), dtype=torch.uint8, generator=rng)
    ids = torch.stack([torch.randperm(e, generator=rng)[:k] for _ in range(t)])
    ids[:, 0] = 2  # expert 2 gets 150 pairs: a full tile and a partial one; some experts may get none
    order, offs = mp.checked_permutation(None, ids.long(), e)
    return xq.to(device), order.to(device), offs.to(device), k


def test_token_image_launches_split_ctas_a_tile_and_checks_its_inputs(rng: torch.Generator) -> None:
    xq, order, offs, k = _image_problem(rng)
    calls: list = []
    img = ws.token_image(xq, order, offs, k, runner=lambda *a: calls.append(a))
    [(spec, grid, args)] = calls
    assert spec.kernel == "moe_ws_image" and grid == (ws.max_tiles(order.numel(), 6), 4) == (img.shape[0], 4)
    tiles = ws.max_tiles(order.numel(), 6)
    assert img.shape[1] == 4 * 16384 and args[3] is img and args[4:] == [512, 6, k, tiles, 0]
    calls.clear()  # with the shared expert's tiles: ceil(150 / 128) more, and T
    img = ws.token_image(xq, order, offs, k, shared=True, runner=lambda *a: calls.append(a))
    assert img.shape == ws.image_shape(order.numel(), 6, 512, 150) == (tiles + 2, 4 * 16384)
    assert calls[0][1] == (tiles + 2, 4) and calls[0][2][4:] == [512, 6, k, tiles, 150]
    with pytest.raises(ShapeError, match="xq must be uint8"):
        ws.token_image(xq.float(), order, offs, k)
    with pytest.raises(ShapeError, match="order and offs int32"):
        ws.token_image(xq, order.long(), offs, k)
    with pytest.raises(ShapeError, match=r"out must be a contiguous uint8 \[\d+, 65536\]"):
        ws.token_image(xq, order, offs, k, out=img[:, :-16])
    assert int(offs[3] - offs[2]) > ws.BT  # (the GPU test's partial second tile of expert 2)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 3, 8])  # (4 stages: CTAs of 4, 2 / 1 and 1 stages)
@pytest.mark.parametrize("shared", [False, True])
def test_token_image_puts_each_sorted_pair_where_the_a_buffer_wants_it_gpu(split: int, shared: bool,
                                                                           rng: torch.Generator,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws, "IMAGE_SPLIT", split)
    xq, order, offs, k = _image_problem(rng, "cuda")
    img = torch.full(ws.image_shape(order.numel(), 6, 512, 150 * shared), 0x7F, dtype=torch.uint8, device="cuda")
    assert ws.token_image(xq, order, offs, k, shared=shared, out=img) is img  # every byte written (padding zero)
    assert torch.equal(img.cpu(), _image_model(xq.cpu(), order.cpu(), offs.cpu(), k, shared))


def _shared_image_model(w: quant.MXFP8Tensor, gate_up: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """shared_image by loops: each row's scale the largest 2^(e - 127) of its blocks holding a nonzero code (1 for
    an all-zero row), its values over it in E4M3; row block rb's stage s, K chunk kc: MMA column n's 16 bytes at
    16 n (column 16 m + r: gate row 128 rb + 8 m + r, 16 m + 8 + r: the up row S on; FC2: row 256 rb + n), 32 zero
    bytes after."""
    v = quant.mxfp8_dequantize(w).double()
    two_s, h = v.shape
    s = two_s // 2
    srow = torch.ones(two_s, dtype=torch.float64)
    for r in range(two_s):
        live = [b for b in range(h // 32) if bool((w.data[r, 32 * b:32 * b + 32].float() != 0).any())]
        if live:
            srow[r] = max(2.0 ** (int(w.scale[r, b]) - 127) for b in live)
    q = (v / srow[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    img = torch.zeros(s // 128, h // 128, 8, 256 * 16 + 32, dtype=torch.uint8)
    for rb in range(s // 128):
        for n in range(256):
            row = (n % 16 >= 8) * s + 128 * rb + 8 * (n // 16) + n % 8 if gate_up else 256 * rb + n
            img[rb, :, :, 16 * n:16 * n + 16] = q[row].view(h // 128, 8, 16)
    return img.view(s // 128, -1), srow.float()


def test_shared_image_reencodes_each_row_on_one_scale_where_fc1_wants_it(rng: torch.Generator) -> None:
    """The shared expert's E4M3 image: the loop model's bytes and row scales, exact for rows whose blocks sit within
    E4M3's normals (2^-6 x the row scale) and within half its subnormal step (2^-10 x the row scale) below, an
    all-zero row, a zero block with a huge scale byte ignored, a block 20 binades under its row losing its bits,
    bad shapes named."""
    s, h = 256, 384
    w = quant.mxfp8_quantize(torch.randn(2 * s, h, generator=rng) / h**0.5)
    w.data[3] = 0  # an all-zero row
    w.data[5, :32] = 0  # a zero block whose scale byte would dwarf the row's
    w.scale[5, 0] = 250
    w.data[7, 64:96] = quant.mxfp8_quantize(torch.randn(1, 32, generator=rng) * 2.0**-20).data[0]
    w.scale[7, 2] = int(w.scale[7].max()) - 20
    img, srow = ws.shared_image(w)
    want, want_row = _shared_image_model(w)
    assert img.shape == (2, 3 * ws.B_BYTES) and torch.equal(img, want) and torch.equal(srow, want_row)
    assert float(srow[3]) == 1.0 and float(srow[5]) < 2.0**100
    back = _shared_image_model(quant.MXFP8Tensor(w.data, w.scale))[0]  # (same bytes: deterministic)
    assert torch.equal(back, img)
    # decode the image back to rows: exact but for row 7's low block
    codes = img.view(2, 3, 8, 256 * 16 + 32)[..., :4096].view(2, 3, 8, 256, 16).permute(0, 3, 1, 2, 4)
    n = torch.arange(256)
    rows = (n % 16 >= 8) * s + 8 * (n // 16) + n % 8
    dec = torch.empty(2 * s, h, dtype=torch.float64)
    dec[torch.arange(2)[:, None] * 128 + rows] = codes.reshape(2, 256, h).view(torch.float8_e4m3fn).double()
    dec *= srow.double()[:, None]
    v = quant.mxfp8_dequantize(w).double()
    rs = srow.double()[:, None]
    normal = v.abs() >= 2.0**-6 * rs  # (E4M3's normals: exact; below, its subnormal step 2^-9 x the row scale)
    assert torch.equal(dec[normal], v[normal]) and bool(((dec - v).abs() <= 2.0**-10 * rs).all())
    assert not torch.equal(dec[7, 64:96], v[7, 64:96]) and float(dec[7, 64:96].abs().max()) <= 2.0**-6 * float(rs[7])
    with pytest.raises(ShapeError, match="N a multiple of 256"):
        ws.shared_image(quant.mxfp8_quantize(torch.randn(2 * 192, h, generator=rng)))
    w2 = quant.mxfp8_quantize(torch.randn(512, 256, generator=rng))  # FC2's [H, S]: rows in order
    img2, srow2 = ws.shared_image(w2, gate_up=False)
    want2, want_row2 = _shared_image_model(w2, gate_up=False)
    assert img2.shape == (2, 2 * ws.B_BYTES) and torch.equal(img2, want2) and torch.equal(srow2, want_row2)


def test_rejects_bad_builds_and_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws, "STAGES", 5)
    with pytest.raises(ConfigError, match="STAGES 5"):
        ws.fc1_spec()
    monkeypatch.setattr(ws, "STAGES", 3)
    u8, f32, i32 = torch.uint8, torch.float32, torch.int32
    xq, xs = torch.zeros(4, 256, dtype=u8), torch.zeros(4, dtype=f32)
    offs, order = torch.zeros(3, dtype=i32), torch.zeros(8, dtype=i32)
    rrow, act = torch.zeros(2, 512), torch.zeros(8, 256, dtype=torch.bfloat16)
    with pytest.raises(ShapeError, match=r"act must be \[T \* top_k, I\]"):  # act rows != T * top_k
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act[:7], top_k=2, wexp=0)
    with pytest.raises(ShapeError, match="I of 128"):
        ws.fc1(xq, xs, order, offs, xq, xq, torch.zeros(2, 192), act[:, :96], top_k=2, wexp=0)
    with pytest.raises(ShapeError, match="H must be a multiple of 256"):  # a 128-K tail has no whole scale chunk
        ws.fc1(torch.zeros(4, 384, dtype=u8), xs, order, offs, xq, xq, rrow, act, top_k=2, wexp=0)
    with pytest.raises(ShapeError, match=r"order must be a contiguous torch\.int32"):
        ws.fc1(xq, xs, order.long(), offs, xq, xq, rrow, act, top_k=2, wexp=0)
    many = ws.MAX_EXPERTS + 1  # past the kernels' tile table
    with pytest.raises(ShapeError, match=f"{many} experts: .*the experts at most {ws.MAX_EXPERTS}"):
        ws.fc1(xq, xs, order, torch.zeros(many + 1, dtype=i32), xq, xq, torch.zeros(many, 512), act, top_k=2,
               wexp=0)
    monkeypatch.setattr(ws, "TBULK", True)
    with pytest.raises(ShapeError, match=r"TBULK reads the tokens' tile image: xt must be .*got None"):
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=2, wexp=0)
    with pytest.raises(ShapeError, match=r"xt must be a contiguous uint8 \[3, 32768\]"):  # a tile too few (3 = max_tiles(8, 2))
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=2, wexp=0, xt=torch.zeros(2, 32768, dtype=u8))
    monkeypatch.setattr(ws, "TBULK", False)
    calls: list = []
    none = torch.zeros(0, 256, dtype=torch.bfloat16)  # no tokens: nothing launched
    assert ws.fc1(xq[:0], xs[:0], order[:0], offs, xq, xq, rrow, none, top_k=2, wexp=0,
                  runner=lambda *a: calls.append(a)) is none and not calls


def test_fc1_launches_the_shared_experts_items_and_checks_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """shared=(image, srow, sact): ceil(T / 128) more tiles (the image made with shared=True), row blocks for the
    larger of I and S, T / S / nsh in the launch; TBULK required; bad shapes and dtypes named."""
    monkeypatch.setattr(ws, "TBULK", True)
    u8, f32, i32, bf16 = torch.uint8, torch.float32, torch.int32, torch.bfloat16
    t, h, i, k, e, s = 200, 512, 256, 2, 3, 384
    p = t * k
    xq, xs = torch.zeros(t, h, dtype=u8), torch.zeros(t, dtype=f32)
    order, offs = torch.zeros(p, dtype=i32), torch.tensor([0, 100, 100, p], dtype=i32)
    rrow, act = torch.zeros(e, 2 * i), torch.zeros(p, i, dtype=bf16)
    img, srow, sact = torch.zeros(s // 128, h // 128 * ws.B_BYTES, dtype=u8), torch.zeros(2 * s), torch.zeros(t, s,
                                                                                                           dtype=bf16)
    xt = torch.zeros(ws.image_shape(p, e, h, t), dtype=u8)
    calls: list = []
    ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=k, wexp=2, xt=xt, shared=(img, srow, sact),
           runner=lambda *a: calls.append(a))
    [(spec, grid, args)] = calls
    tiles = ws.max_tiles(p, e)
    assert spec is ws.fc1_spec() and xt.shape[0] == tiles + 2 and grid == ((tiles + 2) * 3,)  # 3 row blocks: S / 128 > I / 128
    assert args[8] is xt and args[9] is img and args[10] is srow and args[11] is sact
    assert args[12:] == [t, h, i, s, e, k, 2, tiles, 2]
    with pytest.raises(ShapeError, match=r"xt must be a contiguous uint8 .*token_image\(xq, order, offs, top_k, "
                                         r"shared=True\)"):
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=k, wexp=2, xt=xt[:tiles], shared=(img, srow, sact))
    for bad in ((img[:1], srow, sact), (img, srow[1:], sact), (img, srow, sact[:, :200]), (img, srow, sact[1:])):
        with pytest.raises(ShapeError, match="the shared expert's act"):
            ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=k, wexp=2, xt=xt, shared=bad)
    with pytest.raises(ShapeError, match=r"sact must be a contiguous torch\.bfloat16"):
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=k, wexp=2, xt=xt, shared=(img, srow, sact.float()))
    monkeypatch.setattr(ws, "TBULK", False)
    with pytest.raises(ConfigError, match="need TBULK"):
        ws.fc1(xq, xs, order, offs, xq, xq, rrow, act, top_k=k, wexp=2, shared=(img, srow, sact))


def _fc1_inputs(x: torch.Tensor, ids: torch.Tensor, w13: quant.NVFP4Tensor) -> tuple[torch.Tensor, ...]:
    """FC1's inputs on the GPU: the sorted pairs (order, offs), w13's prepacked copy and row scales, the E4M3 token
    rows and their scales (moe_pf_quant, natural K order)."""
    (t, h), e, two_i = x.shape, w13.shape[0], w13.shape[1]
    order, offs = mp.checked_permutation(None, ids.long(), e)
    c13, s13 = moe_cuda.packed_pair(w13)
    g13 = mp.nvfp4_row_scales(w13, (e, two_i), "w13")
    xq = torch.empty(t, h, dtype=torch.uint8, device="cuda")
    xs = torch.empty(t, device="cuda")
    jit_run(pc.specs("fp8")[2], (t,), [x.bfloat16(), xq, xs, h, 0])
    return order, offs, c13, s13, g13, xq, xs


def _act_model(x: torch.Tensor, ids: torch.Tensor, order: torch.Tensor, w13: quant.NVFP4Tensor) -> torch.Tensor:
    """act of each sorted pair in float64, rounded as the kernel rounds (module docstring)."""
    xq = _e4m3_rows(x.bfloat16())
    k, inter = ids.shape[1], w13.data.shape[1] // 2
    order = order.long()
    tok, ex = order // k, ids.reshape(-1)[order]
    out = torch.zeros(order.numel(), inter, dtype=torch.float64, device=x.device)
    for i in range(w13.data.shape[0]):
        rows = (ex == i).nonzero(as_tuple=True)[0]
        out[rows] = _swiglu_bf16(xq[tok[rows]] @ _e4m3_weights(w13, i).t(), inter)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("t, h, inter, e, k, skew, empty", [(300, 512, 256, 8, 2, True, 3),
                                                             (1000, 6144, 1536, 64, 8, False, 2),
                                                             (200, 256, 128, 400, 4, True, 150)])
def test_fc1_matches_its_rounding_model_gpu(t: int, h: int, inter: int, e: int, k: int, skew: bool, empty: int,
                                            build: tuple[int, ...], rng: torch.Generator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial tiles (a skewed expert, empty experts; 400 experts: a tile table of two passes), every sorted pair's
    row written (NaN-poisoned act), within the E4M3 accumulator's loss of the float64 model; deterministic; the LUT,
    bulk-copy, PERSIST and TMAJOR knobs bitwise the plain build (they change where bytes come from and which CTA runs
    an item, not the arithmetic)."""
    _set_build(monkeypatch, build)
    x, ids, _, w13, _, _, _ = _problem(t, h, inter, e, k, 0, "nvfp4", None, rng, skew=skew, empty=empty)
    x, ids, w13 = _to(x, "cuda"), _to(ids, "cuda"), _to(w13, "cuda")
    order, offs, c13, s13, g13, xq, xs = _fc1_inputs(x, ids, w13)
    xt = ws.token_image(xq, order, offs, k)
    act = torch.full((t * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws.fc1(xq, xs, order, offs, c13, s13, g13, act, top_k=k, wexp=pc.fp8_exponent(w13), xt=xt)
    assert torch.isfinite(act).all()
    model = _act_model(x, ids, order, w13)
    rel = float((act.double() - model).norm() / model.norm())
    assert rel < 3e-2, rel
    again = torch.full_like(act, float("nan"))
    ws.fc1(xq, xs, order, offs, c13, s13, g13, again, top_k=k, wexp=pc.fp8_exponent(w13), xt=xt)
    assert torch.equal(again, act), "not deterministic"
    if any(build[2:]):  # bitwise the build without LUT, bulk copies and persistence, at the same stages
        _set_build(monkeypatch, (*build[:2], 0, 0, 0, 0))
        again.fill_(float("nan"))
        ws.fc1(xq, xs, order, offs, c13, s13, g13, again, top_k=k, wexp=pc.fp8_exponent(w13))
        assert torch.equal(again, act)


@pytest.mark.gpu
@pytest.mark.parametrize("build", [b for b in BUILDS if b[3]])  # (the shared items need TBULK)
@pytest.mark.parametrize("t, h, inter, e, k, s, skew", [(300, 512, 256, 8, 2, 384, True), (150, 512, 512, 4, 2, 128, False),
                                                         (1000, 6144, 1536, 64, 8, 1536, False)])
def test_fc1_shared_items_match_their_model_gpu(t: int, h: int, inter: int, e: int, k: int, s: int, skew: bool,
                                                build: tuple[int, ...], rng: torch.Generator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared expert's items in FC1's launch (S above, below and equal to I; a partial last token tile): its act
    [T, S] within the E4M3 accumulator's loss of the float64 model (E4M3 token rows x its re-encoded E4M3 rows), every
    element written (NaN-poisoned), and the routed act bitwise what the launch without them writes."""
    _set_build(monkeypatch, build)
    x, ids, _, w13, _, sh13, _ = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng, skew=skew, empty=1)
    x, ids, w13, sh13 = _to(x, "cuda"), _to(ids, "cuda"), _to(w13, "cuda"), _to(sh13, "cuda")
    order, offs, c13, s13, g13, xq, xs = _fc1_inputs(x, ids, w13)
    img, srow = ws.shared_image(sh13)
    wexp = pc.fp8_exponent(w13)
    act = torch.full((t * k, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    sact = torch.full((t, s), float("nan"), dtype=torch.bfloat16, device="cuda")
    xt = ws.token_image(xq, order, offs, k, shared=True)
    ws.fc1(xq, xs, order, offs, c13, s13, g13, act, top_k=k, wexp=wexp, xt=xt, shared=(img, srow, sact))
    assert torch.isfinite(sact).all() and torch.isfinite(act).all()
    model = _swiglu_bf16(_e4m3_rows(x.bfloat16()) @ _e4m3_rescaled(sh13).t(), s)
    rel = float((sact.double() - model).norm() / model.norm())
    assert rel < 3e-2, rel
    alone = torch.full_like(act, float("nan"))
    ws.fc1(xq, xs, order, offs, c13, s13, g13, alone, top_k=k, wexp=wexp, xt=ws.token_image(xq, order, offs, k))
    assert torch.equal(alone, act)


@pytest.mark.gpu
@pytest.mark.parametrize("persist, tmajor", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("t, h, inter, e, k, s", [(300, 512, 256, 8, 2, 384), (1000, 6144, 1536, 64, 8, 1536)])
def test_fc2_shared_items_match_their_model_gpu(t: int, h: int, inter: int, e: int, k: int, s: int, persist: bool,
                                                tmajor: bool, rng: torch.Generator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """FC2's shared-expert items (a partial last tile; S unlike I): alone they write y[:, top_k] only (the routed
    slots stay NaN), within the E4M3 accumulator's loss of the float64 model (E4M3 act rows x its re-encoded E4M3
    rows); with the routed items in one launch each slot is bitwise what the separate launches wrote."""
    monkeypatch.setattr(ws, "PERSIST", persist)
    monkeypatch.setattr(ws, "TMAJOR", tmajor)
    _, ids, wts, _, w2, _, sh2 = _problem(t, h, inter, e, k, s, "nvfp4", "mxfp8", rng, empty=1)
    ids, wts, w2, sh2 = _to(ids, "cuda"), _to(wts, "cuda").reshape(-1).contiguous(), _to(w2, "cuda"), _to(sh2, "cuda")
    order, offs = mp.checked_permutation(None, ids.long(), e)
    c2, s2 = moe_cuda.packed_pair(w2)
    g2 = mp.nvfp4_row_scales(w2, (e, h), "w2")
    quant_spec, p = pc.specs("fp8")[2], t * k
    act = torch.randn(p, inter, generator=rng).bfloat16().cuda()
    sact = torch.randn(t, s, generator=rng).bfloat16().cuda()
    act8, a_s = torch.empty(p, inter, dtype=torch.uint8, device="cuda"), torch.empty(p, device="cuda")
    sact8, sas = torch.empty(t, s, dtype=torch.uint8, device="cuda"), torch.empty(t, device="cuda")
    jit_run(quant_spec, (p,), [act, act8, a_s, inter, 0])
    jit_run(quant_spec, (t,), [sact, sact8, sas, s, 0])
    xt = ws.token_image(act8, torch.arange(p, dtype=torch.int32, device="cuda"), offs, 1)
    st = ws.token_image(sact8, order[:0], offs, 1, shared=True)
    sh = (st, sas, *ws.shared_image(sh2, gate_up=False))
    wexp = pc.fp8_exponent(w2)
    run = [act8, a_s, order, wts, offs, c2, s2, g2]
    alone = torch.full((t, k + 1, h), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws.fc2(*run, alone, st, top_k=k, wexp=wexp, shared=sh, routed=False)
    assert torch.isnan(alone[:, :k]).all() and torch.isfinite(alone[:, k]).all()
    model = _bf16(_e4m3_rows(sact) @ _e4m3_rescaled(sh2).t())
    rel = float((alone[:, k].double() - model).norm() / model.norm())
    assert rel < 3e-2, rel
    ws.fc2(*run, alone, xt, top_k=k, wexp=wexp)  # the routed slots by a launch of their own
    both = torch.full_like(alone, float("nan"))
    ws.fc2(*run, both, xt, top_k=k, wexp=wexp, shared=sh)
    assert torch.isfinite(both).all() and torch.equal(both, alone)
