"""Fusion: one MoE block (router, top-k, routed SwiGLU experts, combine, shared expert) → one ``megamoe``.

Matches, in the canonicalized graph, the chain :class:`m3c.model_defs.layers.MoE` traces to::

    scores = sigmoid(linear([cast](x), cast(gate_w)))       ids = topk(add(scores, bias)).1
    w = gather(scores, ids) [/ (sum(w) + eps)] [× scale]     (×1 is gone after canonicalization)
    act = silu(split(grouped_gemm(x, ids, w13))[0]) · [1]   down = grouped_gemm(act, ids, w2)
    out = sum(down · unsqueeze([cast](w)), dims=[1])

in two steps of one pass: the *routed* rewrites replace the chain above by ``megamoe`` without a
shared expert; the *shared* rewrites then fold ``add(megamoe(...), linear(swiglu(linear(x, W13')),
W2'))`` into it, with ``W'`` = ``dequantize(w)`` / ``cast(dequantize(w))`` / ``cast(w)`` / ``w``.
Routed forms: a model whose router runs in x's dtype (no casts) or in a wider one (x and the
weights cast) × renormalized top-k weights or not × a routed scale or none. Every intermediate
must be used only inside the chain (the rewriter refuses otherwise).
"""

from __future__ import annotations

from typing import Any

from m3c.ir.graph import Value
from m3c.ir.registry import get_op
from m3c.passes.rewrite import Builder, Check, Match, P, Rewrite, RewritePass, V, X, op_accepts

PASS_NAME = "fuse_megamoe"
SHARED_FORMS = ("dequantize", "cast_dequantize", "cast", "plain")


def _dtype(m: Match, name: str) -> str:
    return m[name].type.dtype.value


def _halves(m: Match, split: str) -> bool:
    """The split gives two equal pieces (gate, up)."""
    sizes = m.node(split).attrs["sizes"]
    return len(sizes) == 2 and sizes[0] == sizes[1]


# ---- routed: the chain up to the weighted combine ------------------------------------------------
def _routed_operands(m: Match) -> tuple[list[Value | None], dict[str, Any]]:
    attrs = {"top_k": m["k"], "routed_scaling_factor": 1.0, "norm_topk_prob": "eps" in m,
             "router_dtype": _dtype(m, "logits")}
    if "scale" in m:
        attrs["routed_scaling_factor"] = m["scale"]
    if "eps" in m and m["eps"] != get_op("megamoe").attrs["renorm_eps"]:  # store only a non-default epsilon
        attrs["renorm_eps"] = m["eps"]
    return [m["x"], m["gate_w"], m["bias"], m["w13"], m["w2"]], attrs


def _routed_checks(widened: bool) -> list[Check]:
    checks = [
        Check("the router weight is cast to the router dtype", lambda m: _dtype(m, "gate_cast") == _dtype(m, "logits")),
        Check("the expert gate/up split has two equal halves", lambda m: _halves(m, "split")),
        Check("the combine keeps x's dtype", lambda m: _dtype(m, "root") == _dtype(m, "x")),
    ]
    if widened:
        checks += [
            Check("x is cast to a wider router dtype", lambda m: _dtype(m, "x_cast") == _dtype(m, "logits")
                  != _dtype(m, "x")),
            Check("the routing weights are cast back to x's dtype", lambda m: _dtype(m, "w_cast") == _dtype(m, "x")),
        ]
    else:
        checks.append(Check("the router runs in x's dtype", lambda m: _dtype(m, "logits") == _dtype(m, "x")))
    checks.append(Check("megamoe accepts the operands", lambda m: op_accepts("megamoe", *_routed_operands(m))))
    return checks


def _routed(widened: bool, norm: bool, scaled: bool) -> Rewrite:
    x = X("x", rank=2)
    router_in = P("cast", x, name="x_cast") if widened else x
    logits = P("linear", router_in, P("cast", X("gate_w"), name="gate_cast"), name="logits")
    scores = P("sigmoid", logits)
    ids = P("topk", P("add", scores, X("bias")), k=V("k"))[1]
    weights: Any = P("gather", scores, ids, dim=1)
    if norm:
        total = P("add", P("sum", weights, dims=[1], keepdim=True), scalar=V("eps"))
        weights = P("div", weights, total)
    if scaled:
        weights = P("mul", weights, scalar=V("scale"))
    if widened:
        weights = P("cast", weights, name="w_cast")
    gate_up = P("split", P("grouped_gemm", x, ids, X("w13")), name="split", dim=2)
    act = P("mul", P("silu", gate_up[0]), gate_up[1])
    down = P("grouped_gemm", act, ids, X("w2"))
    root = P("sum", P("mul", down, P("unsqueeze", weights, dim=2), commutative=True), name="root", dims=[1],
             keepdim=False)
    name = f"moe_routed_{'widened' if widened else 'plain'}_{'norm' if norm else 'nonorm'}_" \
           f"{'scaled' if scaled else 'unscaled'}"

    def build(m: Match, b: Builder) -> list[Value]:
        operands, attrs = _routed_operands(m)
        return b.add("megamoe", operands, attrs, names=["moe"])

    return Rewrite(name, root, build, where=_routed_checks(widened))


# ---- shared: fold the shared expert into a routed megamoe ----------------------------------------
def _shared_weight(form: str, name: str) -> Any:
    if form == "dequantize":
        return P("dequantize", X(name), name=f"{name}_full")
    if form == "cast_dequantize":
        return P("cast", P("dequantize", X(name)), name=f"{name}_full")
    if form == "cast":
        return P("cast", X(name), name=f"{name}_full")
    return X(name)


def _shared_operands(m: Match) -> tuple[list[Value | None], dict[str, Any]]:
    moe = m.node("moe")
    return [*moe.inputs[:5], m["sw13"], m["sw2"]], dict(moe.attrs)


def _shared(form: str) -> Rewrite:
    x = X("x")
    moe = P("megamoe", x, X(), X(), X(), X(), name="moe")  # no shared operands yet
    gate_up = P("split", P("linear", x, _shared_weight(form, "sw13")), name="split", dim=1)
    down = P("linear", P("mul", P("silu", gate_up[0]), gate_up[1]), _shared_weight(form, "sw2"))
    root = P("add", moe, down, commutative=True, name="root")
    full = "sw13_full", "sw2_full"
    checks = [
        Check("the shared gate/up split has two equal halves", lambda m: _halves(m, "split")),
        Check("the shared weights enter the linears in x's dtype",
              lambda m: all(_dtype(m, n) == _dtype(m, "x") for n in (full if form != "plain" else ("sw13", "sw2")))),
        Check("megamoe accepts the shared operands", lambda m: op_accepts("megamoe", *_shared_operands(m))),
    ]

    def build(m: Match, b: Builder) -> list[Value]:
        operands, attrs = _shared_operands(m)
        return b.add("megamoe", operands, attrs, names=["moe"])

    return Rewrite(f"moe_shared_{form}", root, build, where=checks)


def fuse_moe_pass() -> RewritePass:
    """The MegaMoE fusion pass: every routed form, then the shared-expert folds (one pass, to a fixpoint)."""
    routed = [_routed(w, n, s) for w in (True, False) for n in (True, False) for s in (True, False)]
    return RewritePass(PASS_NAME, [*routed, *(_shared(form) for form in SHARED_FORMS)])
