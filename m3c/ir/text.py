"""The IR's text form: a graph prints as a small program and parses back to an equal graph.

Grammar (whitespace and newlines are free; ``#`` starts a comment)::

    graph    := "graph" "@" name "(" [input ("," input)* [","]] ")" "{" [meta] stmt* return "}"
    input    := value ":" type kind                     kind: input | param | state
    meta     := "meta" JSON-object                      graph.meta, omitted when empty
    stmt     := [value ":" type ("," value ":" type)* "="] op "(" [operand ("," operand)*] ")"
                ["{" attr ("," attr)* "}"] ["# " scope]
    operand  := value | "_"                             "_" is an absent optional operand
    attr     := key "=" JSON                            keys sorted; floats exact (inf/nan as Infinity/NaN)
    return   := "return" [value ("," value)*]
    value    := "%" name                                name: letters, digits, "_", "."; else a JSON string
    type     := dtype "[" [dim ("," dim)*] "]"          dims: ints or sympy expressions (T, 4*T, T+1)

A statement's trailing comment is its node's scope (a JSON string when it would not read back plainly);
other comments are ignored. Example::

    graph @main(%ids: i64[T] input, %w: f32[512,128] param) {
      %x: f32[T,128] = embedding(%w, %ids)  # embed_tokens
      %a: f32[T,64], %b: f32[T,64] = split(%x) {dim=-1, sizes=[64,64]}
      return %a
    }
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import re
from typing import Any

import sympy

from m3c.errors import M3CError
from m3c.ir.graph import INPUT_KINDS, Graph, Node, Value
from m3c.ir.ops.infer import types_equal
from m3c.ir.types import TensorType, dim_str

_NAME = re.compile(r"[\w.]+")
_IDENT = re.compile(r"[A-Za-z_][\w.]*")
_KEY = re.compile(r"[A-Za-z_]\w*")
_WRAP = 100  # a signature longer than this prints one input a line
_SPACE = re.compile(r"\s*")
_SPACE_COMMENTS = re.compile(r"(?:\s+|#[^\n]*)*")
_TYPE_START = re.compile(r"\w+\[")
_TYPE = re.compile(r"\w+\[[^\]\n]*\]")
_META = re.compile(r"meta\s*[{\[]")
_DECODER = json.JSONDecoder()


class IRParseError(M3CError, ValueError):
    """Text that is not a well-formed graph; the message gives the line number."""


# ---- printing ------------------------------------------------------------------------------------
def _name(name: str) -> str:
    return name if _NAME.fullmatch(name) else json.dumps(name)


def _json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise M3CError(f"{where}: {value!r} has no JSON form ({e}); attributes and meta must be JSON values") from None


def _scope(scope: str) -> str:
    plain = scope == scope.strip() and scope.isprintable() and not scope.startswith('"')
    return scope if plain else json.dumps(scope)


def _print_node(node: Node) -> str:
    outs = ", ".join(f"%{_name(v.name)}: {v.type}" for v in node.outputs)
    ins = ", ".join("_" if v is None else f"%{_name(v.name)}" for v in node.inputs)
    line = f"{outs} = " if outs else ""
    line += f"{node.op}({ins})"
    if node.attrs:
        items = (f"{k if _KEY.fullmatch(k) else json.dumps(k)}={_json(v, f'{node.op} attribute {k}')}"
                 for k, v in sorted(node.attrs.items()))
        line += " {" + ", ".join(items) + "}"
    if node.scope:
        line += f"  # {_scope(node.scope)}"
    return line


def print_graph(g: Graph) -> str:
    """The graph as text that :func:`parse_graph` reads back."""
    params = [f"%{_name(v.name)}: {v.type} {v.kind}" for v in g.inputs]
    head = f"graph @{_name(g.name)}(" + ", ".join(params) + ") {"
    if len(head) > _WRAP:
        head = f"graph @{_name(g.name)}(\n" + "".join(f"    {p},\n" for p in params) + ") {"
    lines = [head]
    if g.meta:
        lines.append(f"  meta {_json(g.meta, 'graph meta')}")
    lines += [f"  {_print_node(n)}" for n in g.nodes]
    outs = ", ".join(f"%{_name(v.name)}" for v in g.outputs)
    lines.append(f"  return {outs}".rstrip())
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- parsing -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _parse_type(text: str) -> TensorType:
    """TensorType.parse, cached: sympy is slow and a graph repeats few distinct types."""
    return TensorType.parse(text)


class _Parser:
    """A character-level recursive-descent parser over one graph's text."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.newlines = [i for i, ch in enumerate(text) if ch == "\n"]
        self.graph = Graph()
        self.env: dict[str, Value] = {}

    # -- low level
    def line(self, pos: int | None = None) -> int:
        return bisect.bisect_left(self.newlines, self.pos if pos is None else pos) + 1

    def error(self, msg: str, pos: int | None = None) -> IRParseError:
        p = self.pos if pos is None else pos
        lineno = self.line(p)
        src = self.text.split("\n")[lineno - 1]
        return IRParseError(f"line {lineno}: {msg}\n  {src.strip()}")

    def skip(self, comments: bool = True) -> None:
        """Skip whitespace and (unless told not to) comments."""
        self.pos = (_SPACE_COMMENTS if comments else _SPACE).match(self.text, self.pos).end()  # type: ignore[union-attr]

    def peek(self, s: str) -> bool:
        self.skip()
        return self.text.startswith(s, self.pos)

    def accept(self, s: str) -> bool:
        if self.peek(s):
            self.pos += len(s)
            return True
        return False

    def expect(self, s: str, what: str = "") -> None:
        if not self.accept(s):
            found = self.text[self.pos:self.pos + 12].split("\n")[0] or "end of text"
            raise self.error(f"expected {s!r}{' ' + what if what else ''}, found {found!r}")

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        self.skip()
        m = pattern.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected {what}")
        self.pos = m.end()
        return m.group()

    def json_value(self, what: str) -> Any:
        self.skip()
        try:
            value, end = _DECODER.raw_decode(self.text, self.pos)
        except json.JSONDecodeError as e:
            raise self.error(f"bad JSON for {what}: {e.msg}", e.pos) from None
        self.pos = end
        return value

    def name(self, what: str) -> str:
        if self.peek('"'):
            value = self.json_value(what)
            if not isinstance(value, str):
                raise self.error(f"expected a name for {what}")
            return value
        return self.match(_NAME, what)

    def type(self) -> TensorType:
        self.skip()
        start = self.pos
        if not _TYPE_START.match(self.text, self.pos):
            raise self.error("expected a tensor type like f32[T,128]")
        m = _TYPE.match(self.text, self.pos)
        if not m or any(c in m.group() for c in "{}%"):
            raise self.error("unclosed tensor type (missing ']')")
        self.pos = m.end()
        try:
            return _parse_type(m.group())
        except ValueError as e:
            msg = str(e) if str(e).startswith("bad ") else f"bad tensor type {m.group()!r}: {e}"
            raise self.error(msg, start) from None

    # -- values
    def define(self, name: str, type: TensorType, kind: str, pos: int) -> Value:
        if name in self.env:
            raise self.error(f"value %{name} is defined twice", pos)
        v = Value(name, type, kind)
        self.env[name] = v
        self.graph._names.add(name)
        return v

    def use(self) -> Value:
        pos = self.pos
        self.expect("%", "(a value)")
        name = self.name("a value name")
        if name not in self.env:
            raise self.error(f"value %{name} is used but not defined before", pos)
        return self.env[name]

    # -- structure
    def parse(self) -> Graph:
        self.expect("graph")
        self.expect("@", "before the graph name")
        self.graph.name = self.name("the graph name")
        self.expect("(")
        while not self.accept(")"):
            pos = self.pos
            self.expect("%", "(a graph input)")
            name = self.name("an input name")
            self.expect(":")
            t = self.type()
            kind = self.match(_KEY, "an input kind")
            if kind not in INPUT_KINDS:
                raise self.error(f"input kind {kind!r} is not one of {', '.join(INPUT_KINDS)}")
            self.graph.inputs.append(self.define(name, t, kind, pos))
            if not self.accept(","):
                self.expect(")", "after the graph inputs")
                break
        self.expect("{")
        self.skip()
        if _META.match(self.text, self.pos):
            self.pos += 4
            meta = self.json_value("graph meta")
            if not isinstance(meta, dict):
                raise self.error("graph meta must be a JSON object")
            self.graph.meta = meta
        while True:
            self.skip()
            if self.peek("return") and not _NAME.match(self.text, self.pos + 6):
                self.pos += 6
                break
            if self.pos >= len(self.text):
                raise self.error("missing 'return' before the end of the text")
            self.graph.nodes.append(self.statement())
        self.skip(comments=False)
        if not self.peek("}") and not self.peek("%"):
            raise self.error("expected return values or '}'")
        outs: list[Value] = []
        if self.peek("%"):
            outs.append(self.use())
            while self.accept(","):
                outs.append(self.use())
        self.graph.outputs = outs
        self.expect("}", "to close the graph")
        self.skip()
        if self.pos != len(self.text):
            raise self.error("unexpected text after the graph")
        return self.graph

    def statement(self) -> Node:
        results: list[tuple[str, TensorType, int]] = []
        if self.peek("%"):
            while True:
                pos = self.pos
                self.expect("%")
                name = self.name("a result name")
                self.expect(":", f"and a type after %{name}")
                results.append((name, self.type(), pos))
                if not self.accept(","):
                    break
            self.expect("=", "after the results")
        op = self.match(_IDENT, "an op name")
        self.expect("(", f"after {op}")
        inputs: list[Value | None] = []
        while not self.accept(")"):
            if self.peek("_") and not _NAME.match(self.text, self.pos + 1):
                self.pos += 1
                inputs.append(None)
            else:
                inputs.append(self.use())
            if not self.accept(","):
                self.expect(")", f"after the operands of {op}")
                break
        end_line = self.line()
        attrs: dict[str, Any] = {}
        self.skip(comments=False)  # a comment here is the scope, and "{" opens the attributes
        if self.text.startswith("{", self.pos):
            self.pos += 1
            while not self.accept("}"):
                key = self.json_value("an attribute name") if self.peek('"') else self.match(_KEY, "an attribute")
                self.expect("=", f"after attribute {key}")
                if key in attrs:
                    raise self.error(f"attribute {key!r} given twice")
                attrs[key] = self.json_value(f"attribute {key}")
                if not self.accept(","):
                    self.expect("}", f"after the attributes of {op}")
                    break
            end_line = self.line()
        node = Node(op, inputs, attrs, [], self.scope(end_line))
        for i, (name, t, pos) in enumerate(results):
            v = self.define(name, t, "result", pos)
            v.producer, v.index = node, i
            node.outputs.append(v)
        return node

    def scope(self, line: int) -> str:
        """A trailing comment on the statement's last line, if any."""
        self.skip(comments=False)
        if not self.text.startswith("#", self.pos) or self.line() != line:
            return ""
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        body = self.text[self.pos + 1:end].strip()
        self.pos = end
        if body.startswith('"'):
            try:
                value = json.loads(body)
            except json.JSONDecodeError as e:
                raise self.error(f"bad quoted scope: {e.msg}") from None
            return str(value)
        return body


def parse_graph(text: str) -> Graph:
    """Read a graph printed by :func:`print_graph` (raises IRParseError naming the line)."""
    return _Parser(text).parse()


# ---- structural equality and hashing -------------------------------------------------------------
def _canonical_attr(value: Any) -> str:
    """Attributes compare by their canonical JSON (so NaN equals NaN, tuples equal lists, 1 != 1.0)."""
    return json.dumps(value, sort_keys=True, default=str)


def _ids(g: Graph) -> dict[Value, tuple[Any, ...]]:
    """Each value's position: ("in", i) for graph inputs, (node index, output index) for results."""
    ids: dict[Value, tuple[Any, ...]] = {v: ("in", i) for i, v in enumerate(g.inputs)}
    for j, node in enumerate(g.nodes):
        for k, v in enumerate(node.outputs):
            ids[v] = (j, k)
    return ids


def _ref(ids: dict[Value, tuple[Any, ...]], v: Value | None) -> tuple[Any, ...] | None:
    if v is None:
        return None
    return ids.get(v, ("foreign", v.name))


def graphs_equal(a: Graph, b: Graph) -> bool:
    """Whether two graphs have the same structure: input kinds and types, ops, attributes, operand wiring,
    output types, in order, and the same outputs. Value and graph names, scopes and meta are ignored."""
    if len(a.inputs) != len(b.inputs) or len(a.nodes) != len(b.nodes) or len(a.outputs) != len(b.outputs):
        return False
    for x, y in zip(a.inputs, b.inputs):
        if x.kind != y.kind or not types_equal(x.type, y.type):
            return False
    ia, ib = _ids(a), _ids(b)
    for m, n in zip(a.nodes, b.nodes):
        if m.op != n.op or len(m.inputs) != len(n.inputs) or len(m.outputs) != len(n.outputs):
            return False
        if sorted(m.attrs) != sorted(n.attrs) or \
                any(_canonical_attr(m.attrs[k]) != _canonical_attr(n.attrs[k]) for k in m.attrs):
            return False
        if any(_ref(ia, u) != _ref(ib, w) for u, w in zip(m.inputs, n.inputs)):
            return False
        if any(not types_equal(u.type, w.type) for u, w in zip(m.outputs, n.outputs)):
            return False
    return all(_ref(ia, u) == _ref(ib, w) for u, w in zip(a.outputs, b.outputs))


def _canonical_type(t: TensorType) -> str:
    dims = (d if isinstance(d, int) else sympy.expand(d) for d in t.shape)
    return f"{t.dtype.value}[{','.join(dim_str(d) for d in dims)}]"


def canonical_text(g: Graph) -> str:
    """The name-normalized print behind :func:`graph_hash`: values renamed by position, no graph name,
    scopes or meta. Graphs that :func:`graphs_equal` calls equal (up to symbolic rewriting) print alike."""
    ids = _ids(g)

    def ref(v: Value | None) -> str:
        r = _ref(ids, v)
        if r is None:
            return "_"
        return f"%{r[1]}" if r[0] == "in" else (f"%{r[0]}.{r[1]}" if r[0] != "foreign" else f"%?{r[1]}")

    lines = [f"{ref(v)}: {_canonical_type(v.type)} {v.kind}" for v in g.inputs]
    for node in g.nodes:
        outs = ", ".join(f"{ref(v)}: {_canonical_type(v.type)}" for v in node.outputs)
        attrs = ", ".join(f"{k}={_canonical_attr(node.attrs[k])}" for k in sorted(node.attrs))
        lines.append(f"{outs} = {node.op}({', '.join(ref(v) for v in node.inputs)}) {{{attrs}}}")
    lines.append("return " + ", ".join(ref(v) for v in g.outputs))
    return "\n".join(lines)


def graph_hash(g: Graph) -> str:
    """sha256 (hex) of the name-normalized print: a compile-cache key, equal for identical layers."""
    return hashlib.sha256(canonical_text(g).encode()).hexdigest()
