"""The explain report: which patterns matched where, which were refused and why, and near misses.

Sample (the m3.1-tiny capture through the cpu pipeline, abridged)::

    explain: pipeline 'cpu' on graph 'm3.1_tiny'
    pass 1 canonicalize: changed (applied=35)
      cat_dims: applied 10× at layers.[0-1].self_attn ×4, layers.2.self_attn ×2
      split_noop: no match; closest: split %split (layers.0.self_attn), 2 constraints held; first failed:
          split %split at layers.0.self_attn: check 'one piece' failed
      rope: applied 10× at layers.[0-1].self_attn ×4, layers.2.self_attn ×2
      no root op in the graph: slice_dims, slice_noop, sub_noop
    pass 2 cse: unchanged (merged=0)
    pass 3 dce: unchanged (removed=0)

A refused match reads ``fuse_x: refused at mul %r (layers.0): fusing would reorder an effect: ...``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m3c.passes.manager import PipelineReport
    from m3c.passes.rewrite import MatchRecord


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def scopes_text(records: list[MatchRecord]) -> str:
    """'layers.[0-59].self_attn ×4, lm_head' — scopes in order of first appearance with counts; scopes
    that differ only in their first numeric part (the layer) and match equally often are merged."""
    counts: dict[str, int] = {}
    for r in records:
        key = r.scope or r.where or "?"
        counts[key] = counts.get(key, 0) + 1
    groups: dict[tuple[str, int], list[int]] = {}
    for key, n in counts.items():
        parts = key.split(".")
        num = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if num is None:
            groups.setdefault((key, n), [])
            continue
        template = ".".join([*parts[:num], "\0", *parts[num + 1:]])
        groups.setdefault((template, n), []).append(int(parts[num]))
    out = []
    for (template, n), idx in groups.items():
        name = template if not idx else template.replace("\0", str(idx[0]) if len(idx) == 1 else
                                                         f"[{_ranges(sorted(idx))}]")
        out.append(name if n == 1 else f"{name} ×{n}")
    return ", ".join(out)


def rewrite_lines(name: str, records: list[MatchRecord]) -> list[str]:
    """Explain lines of one rewrite."""
    applied = [r for r in records if r.status == "applied"]
    refused = [r for r in records if r.status == "refused"]
    missed = [r for r in records if r.status == "missed"]
    lines = []
    if applied:
        lines.append(f"  {name}: applied {len(applied)}× at {scopes_text(applied)}")
    for r in refused:
        lines.append(f"  {name}: refused at {r.where}{f' ({r.scope})' if r.scope else ''}: {r.reason}")
    for r in missed:
        lines.append(f"  {name}: no match; closest: {r.where}{f' ({r.scope})' if r.scope else ''}, "
                     f"{r.progress} constraint{'s' if r.progress != 1 else ''} held; first failed:")
        lines.append(f"      {r.reason}")
    return lines


def explain_text(report: PipelineReport) -> str:
    """The whole explain report of a pipeline run."""
    lines = [f"explain: pipeline {report.pipeline!r} on graph {report.graph!r}"]
    for i, p in enumerate(report.passes, start=1):
        stats = ", ".join(f"{k}={v}" for k, v in p.result.stats.items())
        lines.append(f"pass {i} {p.name}: {'changed' if p.changed else 'unchanged'}{f' ({stats})' if stats else ''}")
        by_rewrite: dict[str, list[MatchRecord]] = {}
        absent: list[str] = []  # rewrites whose root op is nowhere in the graph
        for r in p.result.records:
            if r.status == "missed" and not r.where:
                absent.append(r.rewrite)
            else:
                by_rewrite.setdefault(r.rewrite, []).append(r)
        for name, records in by_rewrite.items():
            lines += rewrite_lines(name, records)
        if absent:
            lines.append(f"  no root op in the graph: {', '.join(absent)}")
    return "\n".join(lines)
