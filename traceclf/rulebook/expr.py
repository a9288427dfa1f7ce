"""The expression language of rule files: Python syntax parsed with :mod:`ast` and evaluated by
walking a whitelist of node types (no ``eval``), and ``{expression:format-spec}`` templates.

A null or missing measure makes an expression null, and a null condition is false (three-valued
logic), so a rule never fires on a measure the trace could not provide.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from traceclf.support.units import counted, fmt_ms, plural


def _coalesce(*args: Any) -> Any:
    return next((a for a in args if a is not None), None)


def _count(n: float, noun: str) -> str:
    """``n`` rounded, and ``noun`` in the number it takes: '1 launch call', '129 calls'
    ('1 synchronising calls' read where a count per step rounds to one)."""
    if not isinstance(noun, str) or isinstance(n, bool) or not isinstance(n, int | float):
        raise TypeError("count(number, noun)")
    if 0 < abs(n) < 0.95:  # (a fraction per step: "0.4 small copies", not "0 small copies")
        return f"{n:.1f} {plural(noun)}"
    return counted(math.floor(n + 0.5), noun)  # (halves up, as a count reads: 2.5 is 3)


def _ms(value: float) -> str | None:
    """A duration given in ms, three significant digits in the unit its size needs: a field
    "{x:.0f} ms" read "0 ms" for 0.143 ms of a 2.4 ms step."""
    return (
        fmt_ms(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    )


def _nonzero(value: Any) -> Any:
    """``value``, or null where it is 0: a ``[[...]]`` clause about a share is then shown only
    where the share is not zero."""
    return None if value == 0 else value


def _when(condition: Any, text: str) -> str | None:
    """``text`` where ``condition`` holds, else null: words a ``[[...]]`` clause shows only
    then ("estimated from the eager warm-up" where the kernel mix is)."""
    if not isinstance(text, str):
        raise TypeError("when(condition, text)")
    return text if condition is True else None


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "coalesce": _coalesce,  # the first argument that is not null: a fallback for a measure
    "count": _count,  # a number with its noun: count(launch_calls_per_step, "launch")
    "ms": _ms,  # a duration in ms as the report writes one: "0.143 ms", "2.4 ms", "1.23 s"
    "nonzero": _nonzero,  # null where 0: a clause shown only for a share that is not zero
    "when": _when,  # words where a condition holds, else null: a clause shown only then
}
_NULL_SAFE = {"coalesce"}  # functions that take null arguments (the others return null)

# Limits that keep parsing, checking and evaluating cheap whatever a rule file says
# (docs/security.md): evaluation recurses once per level, and integers are capped at 64 bits
# (beyond, they become floats, which overflow to an unknown value instead of growing: forty
# definitions that each square the one before would otherwise build a 2**40-bit integer).
_MAX_EXPR_CHARS = 1000
MAX_EXPR_DEPTH = 40
MAX_INT = 2**63
# A {x:>1000000000} or {x:.1000000000f} field would build a gigabyte string per rendering.
MAX_FORMAT_NUMBER = 100
_MAX_SPEC_CHARS = 20


class ExprError(ValueError):
    """An expression that cannot be parsed or uses something outside the language."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Compare,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Call,
    *_BINOPS,
    *_CMPOPS,
)


@dataclass(frozen=True)
class Expr:
    """A parsed, checked expression. ``value(env)`` is None when the answer is unknown."""

    source: str
    tree: ast.Expression = field(repr=False, compare=False)
    names: frozenset[str] = field(compare=False)

    @classmethod
    def parse(cls, source: str) -> Expr:
        if len(source) > _MAX_EXPR_CHARS:
            raise ExprError(f"longer than {_MAX_EXPR_CHARS} characters")
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as e:
            raise ExprError(f"{source.strip()!r} is not a valid expression ({e.msg})") from None
        except (RecursionError, MemoryError):
            raise ExprError(f"{source.strip()[:40]!r}... is nested too deeply") from None
        except ValueError as e:  # e.g. a NUL byte in the source
            raise ExprError(f"not a valid expression ({e})") from None
        return cls(source.strip(), tree, frozenset(_check(tree)))

    def value(self, env: Mapping[str, Any]) -> Any:
        return _eval(self.tree.body, env)

    def holds(self, env: Mapping[str, Any]) -> bool:
        return _truth(self.value(env)) is True


def _check(tree: ast.Expression) -> set[str]:
    """Reject a tree nested deeper than MAX_EXPR_DEPTH and every node outside the whitelist;
    return the variable names used. One walk, without recursion (a deep tree is what is being
    refused): a rule folder at its limits holds thousands of expressions."""
    names: set[str] = set()
    functions: set[int] = set()  # the Name nodes that are called, not read
    pending: list[tuple[ast.AST, int]] = [(tree, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > MAX_EXPR_DEPTH:
            raise ExprError(f"nested too deeply (more than {MAX_EXPR_DEPTH} levels)")
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"{_describe(node)} is not allowed")
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name not in _FUNCTIONS or node.keywords or not node.args:
                shown = name or ast.unparse(node.func)
                raise ExprError(f"call of {shown!r} is not allowed (only {', '.join(_FUNCTIONS)})")
            functions.add(id(node.func))
        elif isinstance(node, ast.Constant) and (
            node.value is None or not isinstance(node.value, (bool, int, float, str))
        ):
            raise ExprError(f"constant {node.value!r} is not allowed (a missing measure is null)")
        elif isinstance(node, ast.Name) and id(node) not in functions:
            names.add(node.id)
        pending.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return names


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.expr):
        return f"{ast.unparse(node)!r} ({type(node).__name__})"
    return f"operator {type(node).__name__}"


def _truth(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _eval(node: ast.expr, env: Mapping[str, Any]) -> Any:
    return _EVAL[type(node)](node, env)


def _eval_bool(node: ast.BoolOp, env: Mapping[str, Any]) -> bool | None:
    # Three-valued logic: false and null = false, true or null = true, otherwise null.
    decisive = isinstance(node.op, ast.Or)
    unknown = False
    for part in node.values:
        t = _truth(_eval(part, env))
        if t is decisive:
            return decisive
        unknown |= t is None
    return None if unknown else not decisive


def _eval_unary(node: ast.UnaryOp, env: Mapping[str, Any]) -> Any:
    v = _eval(node.operand, env)
    if v is None:
        return None
    if isinstance(node.op, ast.Not):
        return not v
    if not _is_number(v):
        return None
    return -v if isinstance(node.op, ast.USub) else +v


def _eval_binop(node: ast.BinOp, env: Mapping[str, Any]) -> Any:
    # Numbers only: "x" * 10**9 or list arithmetic would be a way to exhaust memory.
    a, b = _eval(node.left, env), _eval(node.right, env)
    if not (_is_number(a) and _is_number(b)):
        return None
    return _safe(_BINOPS[type(node.op)], a, b)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


def _eval_compare(node: ast.Compare, env: Mapping[str, Any]) -> bool | None:
    left = _eval(node.left, env)
    unknown = False
    for op, comparator in zip(node.ops, node.comparators, strict=True):
        right = _eval(comparator, env)
        t = None if left is None or right is None else _safe(_CMPOPS[type(op)], left, right)
        if t is False:
            return False
        unknown |= t is None
        left = right
    return None if unknown else True


def _eval_call(node: ast.Call, env: Mapping[str, Any]) -> Any:
    args = [_eval(a, env) for a in node.args]
    if node.func.id not in _NULL_SAFE and any(a is None for a in args):  # type: ignore[attr-defined]
        return None
    return _safe(_FUNCTIONS[node.func.id], *args)  # type: ignore[attr-defined]


def _safe(fn: Callable[..., Any], *args: Any) -> Any:
    """Type mismatches and division by zero make the value unknown, never an exception."""
    try:
        out = fn(*args)
        if isinstance(out, int) and not isinstance(out, bool) and abs(out) >= MAX_INT:
            out = float(out)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    return None if isinstance(out, float) and not math.isfinite(out) else out


_EVAL: dict[type, Callable[[Any, Mapping[str, Any]], Any]] = {
    ast.Constant: lambda n, env: n.value,
    ast.Name: lambda n, env: env.get(n.id),
    ast.List: lambda n, env: [_eval(e, env) for e in n.elts],
    ast.Tuple: lambda n, env: [_eval(e, env) for e in n.elts],
    ast.BoolOp: _eval_bool,
    ast.UnaryOp: _eval_unary,
    ast.BinOp: _eval_binop,
    ast.Compare: _eval_compare,
    ast.Call: _eval_call,
}


# ---------------------------------------------------------------------------------------------
# Templates: text with {expression} or {expression:format-spec} fields; {{ and }} are braces;
# [[ ... ]] is a clause left out when a field in it has no value (a link's peak where the GPU
# is unknown: "against n/a GB/s for n/a" says nothing).

_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_CLAUSE = re.compile(r"\[\[|\]\]")

_Part = str | tuple[Expr, str]


@dataclass(frozen=True)
class Template:
    source: str
    # each clause: its parts; the text outside any clause is a clause that always shows
    clauses: tuple[tuple[bool, tuple[_Part, ...]], ...] = field(repr=False, compare=False)

    @classmethod
    def parse(cls, source: str) -> Template:
        clauses: list[tuple[bool, tuple[_Part, ...]]] = []
        pos, optional = 0, False
        for m in _CLAUSE.finditer(source):
            if m.group(0) == "[[" and optional:
                raise ExprError(f"'[[' inside a [[clause]] in {source!r} (clauses do not nest)")
            if m.group(0) == "]]" and not optional:
                raise ExprError(f"unmatched ']]' in {source!r}")
            clauses.append((optional, _parts(source[pos : m.start()], source)))
            pos, optional = m.end(), not optional
        if optional:
            raise ExprError(f"unmatched '[[' in {source!r}")
        clauses.append((False, _parts(source[pos:], source)))
        return cls(source, tuple(c for c in clauses if c[1]))

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(
            *(p[0].names for _, parts in self.clauses for p in parts if isinstance(p, tuple))
        )

    @property
    def parts(self) -> tuple[_Part, ...]:
        """Every part, the clauses' included (for a reading without the trace's values)."""
        return tuple(p for _, parts in self.clauses for p in parts)

    def render(self, env: Mapping[str, Any]) -> str:
        out = []
        for optional, parts in self.clauses:
            values = [p if isinstance(p, str) else (p[0].value(env), p[1]) for p in parts]
            if optional and any(v[0] is None for v in values if isinstance(v, tuple)):
                continue  # (a clause whose number the trace lacks: left out)
            out += [v if isinstance(v, str) else _format(*v) for v in values]
        # (a sentence: "a [[ {b} ]] c" reads "a c" without b, "a 1 c" with it)
        return re.sub(r" {2,}", " ", "".join(out)).strip()


def _parts(text: str, source: str) -> tuple[_Part, ...]:
    parts: list[_Part] = []
    pos = 0
    for m in _FIELD.finditer(text):
        parts.append(text[pos : m.start()])
        pos = m.end()
        token = m.group(0)
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif m.group(1) is None:
            raise ExprError(f"unmatched {token!r} in {source!r} (write {token * 2} for one)")
        else:
            parts.append(_field(m.group(1)))
    parts.append(text[pos:])
    return tuple(p for p in parts if p != "")


def _field(text: str) -> tuple[Expr, str]:
    try:
        return Expr.parse(text), ""
    except ExprError:
        if ":" not in text:
            raise
    expr, _, spec = text.rpartition(":")
    parsed = Expr.parse(expr)
    numbers = [int(n) for n in re.findall(r"\d+", spec[:_MAX_SPEC_CHARS])]
    if len(spec) > _MAX_SPEC_CHARS or any(n > MAX_FORMAT_NUMBER for n in numbers):
        raise ExprError(
            f"format spec {spec[:_MAX_SPEC_CHARS]!r} in {{{expr}:...}}: width and precision "
            f"must be at most {MAX_FORMAT_NUMBER}"
        )
    if not (_formats(0.5, spec) or _formats("x", spec)):
        raise ExprError(f"bad format spec {spec!r} in {{{text}}}")
    return parsed, spec


def _formats(value: Any, spec: str) -> bool:
    try:
        format(value, spec)
    except (ValueError, TypeError):
        return False
    return True


def _format(value: Any, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    if spec and _formats(value, spec):
        return _below_precision(value, spec) or format(value, spec)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _below_precision(value: Any, spec: str) -> str | None:
    """A share above zero that its percentage prints as zero, written as under the last digit
    ("<1%" for ``.0%``, "<0.1%" for ``.1%``): "0%" says the trace showed none."""
    digits = re.fullmatch(r"\.(\d)%", spec)
    if digits is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if value <= 0 or float(format(value, spec)[:-1]) != 0:
        return None
    return f"<{10 ** -int(digits.group(1)) / 100:{spec}}"
