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
from collections.abc import Callable, Sequence
from typing import Any

from m3c.errors import M3CError
from m3c.model_defs.capacity import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GB,
    GPUS,
    Layout,
    plan,
)
from m3c.model_defs.config import KV_CACHE_DTYPES, M3Config
from m3c.model_defs.presets import PRESETS, get_preset

Subparsers = Any  # argparse's _SubParsersAction is private


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
        help="prefill a random prompt and decode greedily; print tokens, KV bytes per token and timing",
        description=(
            "Builds the model (a preset with random weights, or a checkpoint directory), prefills "
            "--batch random prompts of --prompt-tokens tokens, then runs --decode-steps greedy decode "
            "steps over the paged KV cache. Prints the generated tokens, the KV-cache bytes per token and "
            "the prefill / per-step decode times. Runs on CUDA when present (--device auto), else the CPU."
        ),
        epilog="examples:\n  m3c run --preset m3.1-tiny --decode-steps 16\n"
        "  m3c run --checkpoint ./ckpt --prompt-tokens 512 --decode-steps 32 --batch 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", default="m3.1-tiny", metavar="NAME",
                       help=f"built-in model with random weights, one of: {', '.join(PRESETS)} (default: %(default)s)")
    model.add_argument("--checkpoint", metavar="DIR", help="an HF-style checkpoint directory instead of --preset")
    p.add_argument("--prompt-tokens", type=int, default=40, metavar="N",
                   help="tokens per prompt; use more than top-k × block size to reach the sparse path "
                   "(default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16, metavar="K", help="greedy decode steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="concurrent requests (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="chunked prefill: at most N prompt tokens per request and step (default: whole prompt)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="override the config's K/V cache format")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda (default: %(default)s)")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    """Run `m3c run`."""
    from m3c.runtime.reference import run_reference

    report = run_reference(
        preset=None if args.checkpoint else args.preset, checkpoint=args.checkpoint,
        prompt_tokens=args.prompt_tokens, decode_steps=args.decode_steps, batch=args.batch,
        prefill_chunk=args.prefill_chunk, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, device=args.device,
    )
    print(report.text())
    return 0


# ---- entry point -----------------------------------------------------------------------------
COMMANDS: list[Callable[[Subparsers], None]] = [_register_plan, _register_run]
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
