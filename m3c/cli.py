"""The ``m3c`` command line: one subcommand per registrar in :data:`COMMANDS`.

A subcommand is two functions: ``_register_<name>(subparsers)`` adds its parser and sets
``func=_cmd_<name>``; ``_cmd_<name>(args) -> int`` does the work by calling library code (no model
or planner logic lives here). Append the registrar to :data:`COMMANDS` to add a subcommand.
Every :class:`~m3c.errors.M3CError` is reported as ``m3c: error: <message>`` with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from m3c.backends.options import MOE_PREFILL_PRECISIONS
from m3c.errors import M3CError
from m3c.model_defs.capacity import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GB,
    GPUS,
    Layout,
    plan,
)
from m3c.model_defs.config import KV_CACHE_DTYPES, MODEL_DTYPES, M3Config
from m3c.model_defs.presets import PRESETS, get_preset

Subparsers = Any  # argparse's _SubParsersAction is private


def _para(text: str) -> str:
    """A description paragraph wrapped for the terminal (RawDescriptionHelpFormatter keeps it as given)."""
    return textwrap.fill(text, width=100, break_on_hyphens=False, break_long_words=False)


class UsageError(M3CError, ValueError):
    """Command-line arguments that do not go together."""


def _load_config(args: argparse.Namespace) -> M3Config:
    """The model config named by --config (a config.json or its directory) or --preset."""
    return M3Config.load(args.config) if args.config else get_preset(args.preset)


# ---- plan ------------------------------------------------------------------------------------
def _register_plan(subparsers: Subparsers) -> None:
    """Add `m3c plan`: KV-cache bytes, weights per GPU and how many sequences fit."""
    gpus = ", ".join(f"{name} ({g.memory_bytes / GB:.0f} GB)" for name, g in GPUS.items())
    p = subparsers.add_parser(
        "plan",
        help="how many sequences of a context length fit on N GPUs (KV cache and weight bytes)",
        description=(
            "Capacity planner. Computes the KV-cache bytes per token (K/V and MSA index keys, per layer "
            "and in total), the weights each GPU holds, and how many concurrent sequences of --context "
            "tokens fit on tp × dp GPUs; the same numbers for an FP8 KV cache are shown for comparison. "
            "Memory per GPU: usable = memory × --gpu-memory-utilization; free for the KV cache = usable - "
            "weights per GPU - --activation-reserve-gb. GB = 1e9 bytes."
        ),
        epilog=(
            "examples:\n"
            "  m3c plan --gpu b300 --tp 4 --context 256k                 # TP4 on 4 B300s\n"
            "  m3c plan --gpu b300 --dp 4 --context 256k                 # DEP4: DP attention + EP experts\n"
            "  m3c plan --gpu h200 --tp 4 --dp 2 --context 1m --json     # 8 H200s, machine-readable\n"
            "  m3c plan --config ./ckpt/config.json --gpu mi355x --tp 4 --context 128k"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--preset", default="m3.1-flash", metavar="NAME",
        help=f"built-in model config, one of: {', '.join(PRESETS)} (default: %(default)s)",
    )
    model.add_argument(
        "--config", metavar="PATH",
        help="an HF-style config.json (or the directory holding it) instead of --preset, e.g. ./ckpt/config.json",
    )
    p.add_argument(
        "--kv-cache-dtype", metavar="DTYPE",
        help=f"format of the cached K and V: one of {', '.join(KV_CACHE_DTYPES)} "
        "(default: the config's, nvfp4 for m3.1-flash); e.g. --kv-cache-dtype fp8",
    )
    p.add_argument(
        "--indexer-kv-dtype", metavar="DTYPE",
        help=f"format of the cached MSA index keys: one of {', '.join(KV_CACHE_DTYPES)} (default: the "
        "config's; set independently of --kv-cache-dtype, like vLLM's indexer_kv_dtype)",
    )
    p.add_argument(
        "--gpu", required=True, metavar="NAME",
        help=f"GPU model, memory in decimal GB: {gpus}",
    )
    p.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="tensor-parallel GPUs per replica; splits the K/V heads (must divide them: 1, 2 or 4 for "
        "m3.1-flash), the index-key head is replicated (default: %(default)s)",
    )
    p.add_argument(
        "--dp", type=int, default=1, metavar="N",
        help="data-parallel attention replicas, each holding its own sequences; --dp 4 with --tp 1 is "
        "DEP4 (default: %(default)s)",
    )
    p.add_argument(
        "--ep", type=int, default=None, metavar="N",
        help="GPUs the routed experts are spread over; must divide tp × dp and the expert count "
        "(default: tp × dp, every GPU holds an equal share)",
    )
    p.add_argument(
        "--context", required=True, metavar="TOKENS",
        help="tokens per sequence: 262144, 256k (k = 1024) or 1m (m = 1048576); rounded up to whole "
        "KV blocks",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION, metavar="FRACTION",
        help="fraction of each GPU's memory for weights + KV cache + activations, as in vLLM; "
        "in (0, 1], e.g. 0.95 (default: %(default)s)",
    )
    p.add_argument(
        "--activation-reserve-gb", type=float, default=DEFAULT_ACTIVATION_RESERVE_BYTES / GB, metavar="GB",
        help="memory per GPU kept for activations, workspaces and CUDA graphs, in decimal GB, e.g. 8 "
        "(default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Run `m3c plan`."""
    cfg = _load_config(args)
    dtypes = {"kv_cache_dtype": args.kv_cache_dtype, "indexer_kv_dtype": args.indexer_kv_dtype}
    dtypes = {k: v for k, v in dtypes.items() if v is not None}
    if dtypes:
        cfg = cfg.replace(**dtypes)
    result = plan(
        cfg,
        args.gpu,
        Layout(tp=args.tp, dp=args.dp, ep=args.ep),
        args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        activation_reserve_bytes=round(args.activation_reserve_gb * GB),
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


# ---- run -------------------------------------------------------------------------------------
def _register_run(subparsers: Subparsers) -> None:
    """Add `m3c run`: prefill + greedy decode of a model, printing tokens, cache bytes and timing."""
    p = subparsers.add_parser(
        "run",
        help="prefill a random prompt and decode greedily (reference model, or a compiled ARTIFACT)",
        description=_para(
            "Without ARTIFACT: builds the reference model (a preset with random weights, or a checkpoint "
            "directory). With ARTIFACT (from `m3c compile`): loads it, checks every file's sha256, and runs "
            "its compiled program through the executor. Either way it prefills --batch random prompts of "
            "--prompt-tokens tokens, then runs --decode-steps greedy decode steps over the paged KV cache, "
            "and prints the generated tokens, the KV-cache bytes per token and the prefill / per-step "
            "decode times. The prompts depend only on --seed, so a compiled run and a reference run of the "
            "same weights (same preset and --seed) must print the same tokens. Runs on CUDA when present "
            "(--device auto), else the CPU."
        ),
        epilog="examples:\n  m3c run --preset m3.1-tiny --decode-steps 16                 # reference model\n"
        "  m3c run --checkpoint ./ckpt --prompt-tokens 512 --decode-steps 32 --batch 4\n"
        "  m3c compile --preset m3.1-tiny -o tiny.m3c && m3c run tiny.m3c --decode-steps 16   # compiled",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("artifact", nargs="?", metavar="ARTIFACT",
                   help="a compiled artifact (.m3c zip or directory) to run instead of the reference model")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default=None, metavar="NAME",
                       help=f"built-in model with random weights, one of: {', '.join(PRESETS)} (default: m3.1-tiny; "
                       "not with ARTIFACT)")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="an HF-style checkpoint directory instead of --preset (not with ARTIFACT)")
    p.add_argument("--prompt-tokens", type=int, default=40, metavar="N",
                   help="tokens per prompt; use more than top-k × block size to reach the sparse path "
                   "(default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16, metavar="K", help="greedy decode steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="concurrent requests (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="chunked prefill: at most N prompt tokens per request and step (default: whole prompt)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="override the config's K/V cache format (reference runs; an artifact fixes its own)")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default=None,
                   help="the reference model's activations and dense weights, as `m3c compile --dtype` (reference "
                   "runs; an artifact fixes its own) (default: float32)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts, and of the random weights of a --preset (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda (default: %(default)s)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly (default: an artifact's decode steps replay CUDA graphs on a GPU)")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    """Run `m3c run`."""
    if args.artifact:
        from m3c.runtime.executor import run_artifact

        if args.preset or args.checkpoint or args.kv_cache_dtype or args.dtype:
            raise UsageError("m3c run ARTIFACT: --preset, --checkpoint, --kv-cache-dtype and --dtype belong to "
                             "reference runs; the artifact fixes its model and formats (recompile to change them)")
        report = run_artifact(args.artifact, prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps,
                              batch=args.batch, prefill_chunk=args.prefill_chunk, seed=args.seed, device=args.device,
                              cuda_graphs=not args.no_cuda_graphs)
        print(report.text())
        return 0
    from m3c.runtime.reference import run_reference

    report = run_reference(
        preset=None if args.checkpoint else (args.preset or "m3.1-tiny"), checkpoint=args.checkpoint,
        prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps, batch=args.batch,
        prefill_chunk=args.prefill_chunk, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, device=args.device,
        dtype=args.dtype or "float32",
    )
    print(report.text())
    return 0


# ---- compile ---------------------------------------------------------------------------------
def _register_compile(subparsers: Subparsers) -> None:
    """Add `m3c compile`: model → IR → passes → Program, saved as an artifact."""
    from m3c.backends.target import list_targets

    targets = ", ".join(t.name for t in list_targets())
    p = subparsers.add_parser(
        "compile",
        help="compile a model (preset, config or checkpoint) for a target into an artifact file",
        description=_para(
            "Captures the model into m3c's IR (torch.export), runs the target's pass pipeline, lowers the "
            "fused graph to a program and saves it as an artifact: a .m3c zip (when -o ends in .m3c) or a "
            "directory, holding manifest.json, graph.m3cir (the IR as text), weights.safetensors and, for "
            "GPU targets, kernels/. The same inputs give a byte-identical artifact. A --preset or --config "
            "gets random weights from --seed; --checkpoint uses real ones. Results are cached under "
            "$M3C_CACHE_DIR (default ~/.cache/m3c) by a hash of config, graph, options, weights and m3c "
            "version; a second identical compile is a cache hit. No GPU is needed to compile."
        ),
        epilog=(
            "examples:\n"
            "  m3c compile --preset m3.1-tiny --target cpu -o tiny.m3c\n"
            "  m3c compile --checkpoint ./ckpt --kv-cache-dtype fp8 -o ckpt-fp8.m3c\n"
            "  m3c compile --preset m3.1-tiny -o tiny.m3c --explain --dump-ir-after all --dump-dir ir/\n"
            "then: m3c inspect tiny.m3c; m3c run tiny.m3c --decode-steps 16"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", metavar="NAME",
                       help=f"built-in model config with random weights, one of: {', '.join(PRESETS)} "
                       "(default: m3.1-tiny)")
    model.add_argument("--config", metavar="PATH",
                       help="an HF-style config.json (or its directory) with random weights, e.g. ./ckpt/config.json")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="an HF-style checkpoint directory (config.json + safetensors): real weights")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="where to write the artifact: PATH.m3c writes one zip file, any other PATH a directory")
    p.add_argument("--target", default="cpu", metavar="NAME",
                   help=f"what to compile for, one of: {targets}, or auto (the GPU target this machine runs, "
                   "else cpu) (default: %(default)s); `m3c targets` shows their facts and which run here")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights of --preset / --config (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="format of the cached K and V, as vLLM's --kv-cache-dtype (default: the config's)")
    p.add_argument("--indexer-kv-dtype", choices=KV_CACHE_DTYPES,
                   help="format of the cached MSA index keys, as vLLM's indexer_kv_dtype (default: the config's)")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="float32",
                   help="the model's activations and dense weights: float32 runs the tokens of the reference model; "
                   "bfloat16 is what the GPU kernels are built for (the hopper MegaMoE prefill's wgmma kernels take "
                   "only bf16 activations) (default: %(default)s)")
    p.add_argument("--moe-prefill-precision", choices=MOE_PREFILL_PRECISIONS,
                   help="MMA inputs of the MegaMoE prefill's routed experts on hopper: bf16 (exact weights, ~0.5%% "
                   "error) or fp8 (E4M3 weights, tokens and activations: ~1.3x faster, ~5%% error) (default: bf16)")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="tokens per KV-cache block, as vLLM's --block-size; for M3 it must equal the MSA block "
                   "size (128 for m3.1-flash, 8 for m3.1-tiny), so it only double-checks")
    p.add_argument("--disable-pass", action="append", default=[], metavar="PASS",
                   help="leave this pass out of the pipeline (repeatable), e.g. to find which pass breaks a model")
    p.add_argument("--verify-each", action="store_true", help="run the IR verifier after every pass")
    p.add_argument("--dump-ir-after", action="append", default=[], metavar="PASS|all",
                   help="print the IR after this pass (repeatable; 'all' dumps the input and every pass) into "
                   "--dump-dir; dumping runs the passes even on a cache hit")
    p.add_argument("--dump-dir", default="m3c-ir-dumps", metavar="DIR",
                   help="where --dump-ir-after writes <pipeline>.<NN>_<pass>.m3ir files (default: %(default)s)")
    p.add_argument("--explain", action="store_true",
                   help="report which fusion patterns matched where, and why the others did not")
    p.add_argument("--dump-kernels", metavar="DIR",
                   help="write every kernel of the program (PTX and cubin for NVIDIA targets) into DIR, e.g. to "
                   "read the SASS with `cuobjdump --dump-sass DIR/*.cubin`")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the compile cache")
    p.add_argument("--progress", action="store_true",
                   help="print one line per stage to stderr (default: only when stderr is a terminal)")
    p.set_defaults(func=_cmd_compile)


def _cmd_compile(args: argparse.Namespace) -> int:
    """Run `m3c compile`."""
    from m3c.backends.options import CompileOptions
    from m3c.compiler import compile_preset
    from m3c.model_defs.config import M3Config
    from m3c.runtime.artifact import save_artifact, sha256_bytes

    if args.target == "auto":
        from m3c.backends.target import auto_target

        args.target = auto_target().name
    options = CompileOptions(target=args.target, kv_cache_dtype=args.kv_cache_dtype,
                             indexer_kv_dtype=args.indexer_kv_dtype, block_size=args.block_size,
                             verify_each=args.verify_each, disable_passes=tuple(args.disable_pass),
                             moe_prefill_precision=args.moe_prefill_precision)
    source: str | M3Config | None = M3Config.load(args.config) if args.config else (args.preset or "m3.1-tiny")
    program, cfg, report = compile_preset(
        None if args.checkpoint else source, target=args.target, checkpoint=args.checkpoint, options=options,
        seed=args.seed, cache=not args.no_cache, dump_ir_after=args.dump_ir_after or None,
        dump_dir=args.dump_dir, explain=args.explain, progress=args.progress or None, dtype=args.dtype)
    path = save_artifact(program, cfg, args.output, report.created_from)
    print(report.text())
    if report.pipeline is not None and report.pipeline.dump_paths:
        print(f"IR dumps   {len(report.pipeline.dump_paths)} files in {args.dump_dir}")
    if args.dump_kernels:
        out = Path(args.dump_kernels)
        out.mkdir(parents=True, exist_ok=True)
        for name, blob in sorted(program.kernels.items()):
            (out / name).write_bytes(blob)
        print(f"kernels    {len(program.kernels)} files in {out}" if program.kernels else
              f"kernels    none ({program.target} runs the IR interpreter)")
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    digest = f", sha256 {sha256_bytes(path.read_bytes())}" if path.is_file() else ""
    print(f"wrote      {path} ({size:,} bytes{digest})")
    return 0


# ---- inspect ---------------------------------------------------------------------------------
def _register_inspect(subparsers: Subparsers) -> None:
    """Add `m3c inspect`: what an artifact holds, after checking every file's hash."""
    p = subparsers.add_parser(
        "inspect",
        help="show an artifact's target, options, model, op counts, weight bytes and file hashes",
        description=_para(
            "Reads an artifact's manifest, checks the size and sha256 of every file it lists (exit status 2 "
            "and a message saying what is wrong if one does not match), parses the IR graph and prints a "
            "summary. Works for artifacts of any target, also ones this machine cannot run."
        ),
        epilog="examples:\n  m3c inspect tiny.m3c\n  m3c inspect tiny.m3c --json | jq .graph.op_counts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="a .m3c zip or an artifact directory")
    p.add_argument("--json", action="store_true", help="print the manifest (verified) as JSON instead")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    """Run `m3c inspect`."""
    from m3c.runtime.artifact import describe, load_artifact

    loaded = load_artifact(args.artifact, check_device=False)
    if args.json:
        print(json.dumps({**loaded.manifest, "verified": True}, indent=2, sort_keys=True))
    else:
        print(describe(loaded))
    return 0


# ---- targets ---------------------------------------------------------------------------------
def _register_targets(subparsers: Subparsers) -> None:
    """Add `m3c targets`: the compile targets, their facts, and which run here."""
    p = subparsers.add_parser(
        "targets",
        help="list compile targets with their hardware facts and whether they run on this machine",
        description=_para(
            "One row per target: architecture, chips, SM/CU count, shared memory per SM, warp/wave size, FP8 "
            "and FP4 tensor-core support, TMEM columns, how NVFP4 values reach the matrix units, the pass "
            "pipeline, and whether this machine can run its programs. Any target can be compiled for here; "
            "only runnable ones can be `m3c run`."
        ),
        epilog="examples:\n  m3c targets\n  m3c targets --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="every fact of every target as JSON")
    p.set_defaults(func=_cmd_targets)


def _cmd_targets(args: argparse.Namespace) -> int:
    """Run `m3c targets`."""
    from m3c.backends.target import list_targets, targets_table

    if args.json:
        print(json.dumps([{**t.facts(), "runnable_here": t.runnable_here()} for t in list_targets()], indent=2))
    else:
        print(targets_table())
    return 0


# ---- bench -------------------------------------------------------------------------------------
def _register_bench(subparsers: Subparsers) -> None:
    """Add `m3c bench`: prefill and decode throughput of an artifact (or the reference model)."""
    p = subparsers.add_parser(
        "bench",
        help="time prefill and greedy decode of an artifact (or a preset's reference model)",
        description=(
            "Runs one warm-up generation, then times a prefill of --batch random prompts of --prompt-tokens "
            "tokens and --decode-steps greedy decode steps on a fresh paged cache. Prints prefill tokens/s and "
            "decode ms/step and tokens/s. With --json, the numbers as JSON."
        ),
        epilog="examples:\n  m3c bench tiny.m3c --prompt-tokens 512 --batch 4\n"
        "  m3c bench --preset m3.1-tiny --device cpu   # the reference model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("artifact", nargs="?", help="an artifact from `m3c compile` (default: the reference model)")
    p.add_argument("--preset", default="m3.1-tiny", help="reference model preset when no artifact is given")
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="N", help="tokens per prompt (default: 128)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="concurrent requests (default: 1)")
    p.add_argument("--decode-steps", type=int, default=16, metavar="K", help="timed decode steps (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="weights seed of the reference model (default: 0)")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default=None,
                   help="the reference model's activations and dense weights (reference runs; an artifact fixes its "
                   "own) (default: float32)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda (default: auto)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="time eager decode steps (default: an artifact's decode steps replay CUDA graphs on a GPU)")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run `m3c bench`."""
    from m3c.errors import ShapeError
    from m3c.model_defs.checkpoint import build_model
    from m3c.runtime.artifact import load_artifact
    from m3c.runtime.bench import random_prompts, timed_generation
    from m3c.runtime.executor import Executor
    from m3c.runtime.reference import resolve_device

    if args.prompt_tokens < 1 or args.batch < 1 or args.decode_steps < 1:
        raise ShapeError("--prompt-tokens, --batch and --decode-steps must be >= 1")
    device = resolve_device(args.device)
    if args.artifact:
        if args.dtype:
            raise UsageError("m3c bench ARTIFACT: --dtype belongs to reference runs; the artifact fixes its own "
                             "(recompile with `m3c compile --dtype`)")
        loaded = load_artifact(args.artifact, device)
        if loaded.cfg is None:
            raise ShapeError(f"{args.artifact}: not an M3 model artifact, nothing to generate with")
        cfg, step, what = loaded.cfg, Executor(loaded, device), f"{args.artifact} ({loaded.program.target})"
        if device == "cuda" and not args.no_cuda_graphs:
            from m3c.runtime.cuda_graphs import GraphedStep

            step = GraphedStep(step)
    else:
        cfg = get_preset(args.preset)
        dtype = args.dtype or "float32"
        step, what = build_model(cfg, seed=args.seed, device=device, dtype=dtype), f"{cfg.name} reference ({dtype})"
    r = timed_generation(step, cfg, random_prompts(cfg, args.batch, args.prompt_tokens), args.decode_steps, device)
    r.pop("tokens")
    if hasattr(step, "replays"):
        r["cuda_graphs"] = step.eager_reason or f"decode replayed {step.replays}×"
    if args.json:
        print(json.dumps({"what": what, "device": device, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                          "decode_steps": args.decode_steps, **r}, indent=2))
    else:
        print(f"{what} on {device}: prefill {args.batch}×{args.prompt_tokens} tokens {r['prefill_s'] * 1e3:.1f} ms "
              f"({r['prefill_tok_s']:,.0f} tok/s); decode {r['decode_ms_per_step']:.2f} ms/step "
              f"({r['decode_tok_s']:,.1f} tok/s)" + (f"; CUDA graphs: {r['cuda_graphs']}" if "cuda_graphs" in r else ""))
    return 0


# ---- entry point -----------------------------------------------------------------------------
COMMANDS: list[Callable[[Subparsers], None]] = [
    _register_compile, _register_inspect, _register_run, _register_bench, _register_plan, _register_targets,
]
"""Registrars, one per subcommand, in the order `m3c --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The `m3c` parser with every subcommand in COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="m3c", description="m3c: a model compiler for the MiniMax-M3 family of LLMs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad usage or input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args))
    except M3CError as e:
        print(f"m3c: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 1
