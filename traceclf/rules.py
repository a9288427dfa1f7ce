"""Rules that name the bound and the fixes, read from YAML data (docs/rules.md).

``rules/*.yaml`` holds four kinds of entries: ``rules`` (a condition on the measures, a score for
one wall, an evidence sentence with the numbers, the fix ids it proposes), ``fixes`` (what to
change: config to paste, preconditions, pitfalls, when it applies at all and how to tell that it
is already applied), ``gpu_families`` (GPU name/chip -> family, for hardware-aware advice) and
``scoring`` (workflow order and thresholds). Adding a rule or a fix needs no Python.

Conditions, scores and ``{...}`` template fields use a small expression language: Python syntax
parsed with :mod:`ast` and evaluated by walking a whitelist of node types (no ``eval``). A null or
missing measure makes an expression null, and a null condition is false.
"""

from __future__ import annotations

import ast
import difflib
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from traceclf.errors import TraceError

WALLS = ("memory", "communication", "host", "compute")

# The stable fix-id vocabulary of the report contract: the bundled rules must define each one.
CONTRACT_FIX_IDS = (
    "selective-recompute",
    "fine-grained-offload",
    "fp8",
    "pp-layout",
    "keep-allocator-cache",
    "deepep",
    "hybridep",
    "ep-overlap",
    "ep-in-nvlink-domain",
    "dp-tp-overlap",
    "cuda-graphs",
    "remove-host-syncs",
    "manual-gc",
    "larger-micro-batch",
    "fused-optimizer",
    "input-pipeline",
    "pinned-memory",
    "grouped-gemm",
    "kernel-fusion",
    "dispatcher-sm-tuning",
)

# Names a rule may use besides the measures: facts about the run, not about one rank's step.
CONTEXT_NAMES: dict[str, str] = {
    "gpu_family": 'GPU family from gpu_families: "hopper", "blackwell", "gb200", ... or "unknown"',
    "gpu_name": "GPU name from TARGET_INFO_GPU (null when unknown)",
    "gpu_chip": "GPU chip name, e.g. GH100 (null when unknown)",
    "gpu_sm_count": "streaming multiprocessors of the GPU",
    "gpu_memory_bytes": "device memory capacity in bytes",
    "rank_count": "ranks analysed together",
    "uses_cuda_graphs": "CUDA-graph executions in the steady state on any rank",
    "comm_libraries": 'communication libraries seen, e.g. ["nccl"], ["deepep", "nccl"]',
    "comm_kinds": 'collective kinds seen, e.g. ["all_to_all", "all_reduce"]',
    "other_comm_kinds": "the collective kinds seen other than all-to-all",
    "straggler_rank": "rank with the most compute per step (null with one rank)",
    "step_time_skew_frac": "spread of step time across ranks, as a fraction of the mean",
    "compute_skew_frac": "spread of compute time per step across ranks, as a fraction",
}

_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs}
_MAX_EXPR_CHARS = 1000
_TOP_KEYS = ("rules", "fixes", "definitions", "gpu_families", "scoring")


# ---------------------------------------------------------------------------------------------
# Expression language


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
        return cls(source.strip(), tree, frozenset(_check(tree)))

    def value(self, env: Mapping[str, Any]) -> Any:
        return _eval(self.tree.body, env)

    def holds(self, env: Mapping[str, Any]) -> bool:
        return _truth(self.value(env)) is True


def _check(tree: ast.Expression) -> set[str]:
    """Reject every node outside the whitelist; return the variable names used."""
    functions = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"{_describe(node)} is not allowed")
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name not in _FUNCTIONS or node.keywords or not node.args:
                shown = name or ast.unparse(node.func)
                raise ExprError(f"call of {shown!r} is not allowed (only min, max, abs)")
        elif isinstance(node, ast.Constant) and (
            node.value is None or not isinstance(node.value, (bool, int, float, str))
        ):
            raise ExprError(f"constant {node.value!r} is not allowed (a missing measure is null)")
        elif isinstance(node, ast.Name) and id(node) not in functions:
            names.add(node.id)
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
    if any(a is None for a in args):
        return None
    return _safe(_FUNCTIONS[node.func.id], *args)  # type: ignore[attr-defined]


def _safe(fn: Callable[..., Any], *args: Any) -> Any:
    """Type mismatches and division by zero make the value unknown, never an exception."""
    try:
        out = fn(*args)
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
# Templates: text with {expression} or {expression:format-spec} fields; {{ and }} are braces.

_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


@dataclass(frozen=True)
class Template:
    source: str
    parts: tuple[str | tuple[Expr, str], ...] = field(repr=False, compare=False)

    @classmethod
    def parse(cls, source: str) -> Template:
        parts: list[str | tuple[Expr, str]] = []
        pos = 0
        for m in _FIELD.finditer(source):
            parts.append(source[pos : m.start()])
            pos = m.end()
            token = m.group(0)
            if token in ("{{", "}}"):
                parts.append(token[0])
            elif m.group(1) is None:
                raise ExprError(f"unmatched {token!r} in {source!r} (write {token * 2} for one)")
            else:
                parts.append(_field(m.group(1)))
        parts.append(source[pos:])
        return cls(source, tuple(p for p in parts if p != ""))

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(*(p[0].names for p in self.parts if isinstance(p, tuple)))

    def render(self, env: Mapping[str, Any]) -> str:
        return "".join(
            p if isinstance(p, str) else _format(p[0].value(env), p[1]) for p in self.parts
        ).strip()


def _field(text: str) -> tuple[Expr, str]:
    try:
        return Expr.parse(text), ""
    except ExprError:
        if ":" not in text:
            raise
    expr, _, spec = text.rpartition(":")
    parsed = Expr.parse(expr)
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
        return format(value, spec)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# The rule set


@dataclass(frozen=True)
class Rule:
    id: str
    wall: str
    when: Expr
    score: Expr
    evidence: Template
    fixes: tuple[str, ...]
    description: str
    enabled: bool
    source: Path


@dataclass(frozen=True)
class Fix:
    id: str
    wall: str
    title: str
    why: Template
    config: str
    preconditions: tuple[str, ...]
    pitfalls: tuple[str, ...]
    pytorch: str | None
    requires: Expr | None
    applied_when: Expr | None
    applied: Template | None
    after: tuple[str, ...]
    source: Path


@dataclass(frozen=True)
class GpuFamily:
    family: str
    match: re.Pattern[str]
    source: Path


@dataclass(frozen=True)
class Scoring:
    workflow: tuple[str, ...]
    meaningful: float  # a wall at least this strong is reported and its fixes proposed
    dominant: float  # below this no wall dominates: the run is reported as balanced
    default_bound: str
    balanced_evidence: Template
    # Each wall's share of the step; when no later wall scores, the largest remaining share
    # names the wall the run will hit once the bound is fixed.
    time_share: dict[str, Expr]
    next_wall_min_share: float


@dataclass(frozen=True)
class Definition:
    name: str
    expr: Expr
    source: Path


@dataclass
class RuleSet:
    rules: dict[str, Rule]
    fixes: dict[str, Fix]
    families: list[GpuFamily]
    scoring: Scoring
    definitions: dict[str, Definition]
    folders: list[Path]


def bundled_rules_dir() -> Path:
    """The rules shipped with traceclf: inside the wheel, else the checkout's rules/."""
    import traceclf

    for folder in (
        Path(traceclf.__file__).parent / "rules",
        Path(__file__).resolve().parents[1] / "rules",
    ):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    raise TraceError(None, "bundled rules not found (reinstall traceclf)")


def known_names() -> frozenset[str]:
    """Every measure (traceclf.measures.MEASURES) and context name a rule may use."""
    from traceclf.measures import MEASURES

    return frozenset(MEASURES) | frozenset(CONTEXT_NAMES)


def load_rules(rules_dir: Path | str | None = None) -> RuleSet:
    """The bundled rule set, with ``rules_dir`` (if given) merged over it: an entry with the id
    of a bundled one replaces it. Raises TraceError naming the file for any problem."""
    folders = [bundled_rules_dir()]
    if rules_dir is not None:
        user = Path(rules_dir)
        if not user.is_dir():
            raise TraceError(user, "rules folder not found")
        if not _yaml_files(user):
            raise TraceError(user, "no rule files (*.yaml) in this folder")
        folders.append(user)
    docs = [[(path, _read_yaml(path)) for path in _yaml_files(folder)] for folder in folders]
    definitions = _parse_definitions(docs)
    names = known_names() | frozenset(definitions)
    rules: dict[str, Rule] = {}
    fixes: dict[str, Fix] = {}
    families: list[GpuFamily] = []
    scoring_raw: dict[str, tuple[Any, Path]] = {}
    for files in docs:
        layer = _parse_layer(files, names)
        rules |= layer["rules"]
        for rule_id, path in layer["disabled"].items():
            if rule_id not in rules:
                raise TraceError(path, f"rule {rule_id!r}: disabled, but no such rule")
            rules[rule_id] = replace(rules[rule_id], enabled=False)
        fixes |= layer["fixes"]
        # A later folder's families are tried first, so a user can refine the bundled ones.
        taken = {f.family for f in layer["families"]}
        families = layer["families"] + [f for f in families if f.family not in taken]
        scoring_raw |= layer["scoring"]
    scoring = _parse_scoring(scoring_raw, names)
    ruleset = RuleSet(rules, fixes, families, scoring, definitions, folders)
    _check_references(ruleset)
    return ruleset


def _yaml_files(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])


def _parse_definitions(docs: list[list[tuple[Path, dict]]]) -> dict[str, Definition]:
    """Named expressions, merged like rules; each may use the measures, the context names and
    the definitions before it."""
    measures = known_names()
    merged: dict[str, Definition] = {}
    for files in docs:
        seen: set[str] = set()
        for path, doc in files:
            raw = doc.get("definitions") or {}
            if not isinstance(raw, dict):
                raise TraceError(path, "definitions: must be a mapping of name: expression")
            for name, source in raw.items():
                label = f"definition {name!r}"
                if not isinstance(name, str) or not name.isidentifier():
                    raise TraceError(path, f"{label}: the name must be an identifier")
                if name in measures or name in seen:
                    what = "a measure or context name" if name in measures else "defined twice"
                    raise TraceError(path, f"{label}: {what}")
                seen.add(name)
                try:
                    merged[name] = Definition(name, Expr.parse(str(source)), path)
                except ExprError as e:
                    raise TraceError(path, f"{label}: {e}") from None
    for i, d in enumerate(merged.values()):
        earlier = measures | frozenset(list(merged)[:i])
        for used in sorted(d.expr.names - earlier):
            where = "a later definition" if used in merged else "unknown"
            raise TraceError(d.source, f"definition {d.name!r}: uses {used!r} ({where})")
    return merged


def _parse_layer(files: list[tuple[Path, dict]], names: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"rules": {}, "disabled": {}, "fixes": {}, "families": [], "scoring": {}}
    for path, doc in files:
        for i, raw in enumerate(_entries(doc, "rules", path)):
            if _is_disable_stub(raw):  # `{id: x, enabled: false}` turns a bundled rule off
                out["disabled"][raw["id"]] = path
                continue
            _add_unique(out["rules"], _parse_rule(raw, path, i, names), path, "rule")
        for i, raw in enumerate(_entries(doc, "fixes", path)):
            _add_unique(out["fixes"], _parse_fix(raw, path, i, names), path, "fix")
        out["families"] += [
            _parse_family(raw, path, i) for i, raw in enumerate(_entries(doc, "gpu_families", path))
        ]
        scoring = doc.get("scoring") or {}
        if not isinstance(scoring, dict):
            raise TraceError(path, "scoring: must be a mapping of settings")
        out["scoring"] |= {k: (v, path) for k, v in scoring.items()}
    return out


def _is_disable_stub(raw: Any) -> bool:
    return (
        isinstance(raw, dict)
        and set(raw) == {"id", "enabled"}
        and raw["enabled"] is False
        and isinstance(raw["id"], str)
    )


def _read_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TraceError(path, f"not valid YAML{where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        problem = " ".join(str(e).split())
        raise TraceError(path, f"cannot read rule file: {problem}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TraceError(path, f"top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    unknown = set(doc) - set(_TOP_KEYS)
    if unknown:
        raise TraceError(
            path,
            f"unknown top-level key {sorted(map(str, unknown))[0]!r} "
            f"(expected {', '.join(_TOP_KEYS)})",
        )
    return doc


def _entries(doc: dict, key: str, path: Path) -> list:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise TraceError(path, f"{key}: must be a list of entries")
    return value


def _add_unique(into: dict, item: Rule | Fix, path: Path, kind: str) -> None:
    if item.id in into:
        raise TraceError(path, f"{kind} {item.id!r}: defined twice in {path.parent.name}/")
    into[item.id] = item


class _Entry:
    """One YAML mapping being parsed; every problem becomes ``TraceError(path, "kind 'id': ...")``."""

    def __init__(
        self,
        raw: Any,
        path: Path,
        kind: str,
        index: int,
        required: Iterable[str],
        optional: Iterable[str],
        names: frozenset[str] = frozenset(),
    ) -> None:
        self.path, self.kind, self.names = path, kind, names
        ident = raw.get("id", raw.get("family")) if isinstance(raw, dict) else None
        self.label = f"{kind} {ident!r}" if isinstance(ident, str) else f"{kind} #{index + 1}"
        if not isinstance(raw, dict):
            self.fail("must be a mapping")
        self.raw = raw
        missing = [k for k in required if raw.get(k) in (None, "")]
        if missing:
            self.fail(f"missing {missing[0]!r}")
        unknown = set(raw) - set(required) - set(optional)
        if unknown:
            self.fail(f"unknown field {sorted(map(str, unknown))[0]!r}")

    def fail(self, problem: str) -> None:
        raise TraceError(self.path, f"{self.label}: {problem}")

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.raw.get(key, default)
        if value is not None and not isinstance(value, str):
            self.fail(f"{key!r} must be text")
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        value = self.raw.get(key) or []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(f"{key!r} must be a list of text")
        return tuple(value)

    def wall(self) -> str:
        wall = self.raw.get("wall")
        if wall not in WALLS:
            self.fail(f"wall {wall!r} is not one of {', '.join(WALLS)}")
        return wall

    def expr(self, key: str) -> Expr | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if isinstance(value, (bool, int, float)):
            value = str(value)  # `score: 0.3` and `when: true` are expressions too
        if not isinstance(value, str):
            self.fail(f"{key!r} must be an expression")
        try:
            parsed = Expr.parse(value)
            _check_names(parsed.names, self.names)
        except ExprError as e:
            self.fail(f"{key!r}: {e}")
        return parsed

    def template(self, key: str) -> Template | None:
        value = self.text(key)
        if value is None:
            return None
        try:
            parsed = Template.parse(" ".join(value.split()))
            _check_names(parsed.names, self.names)
        except ExprError as e:
            self.fail(f"{key!r}: {e}")
        return parsed


def _check_names(used: frozenset[str], known: frozenset[str]) -> None:
    for name in sorted(used - known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ExprError(f"unknown measure {name!r}{hint}")


_RULE_REQUIRED = ("id", "wall", "when", "score", "evidence")
_RULE_OPTIONAL = ("fixes", "description", "enabled")
_FIX_REQUIRED = ("id", "wall", "title", "why", "config")
_FIX_OPTIONAL = (
    "preconditions",
    "pitfalls",
    "pytorch",
    "requires",
    "applied_when",
    "applied",
    "after",
)


def _parse_rule(raw: Any, path: Path, index: int, names: frozenset[str]) -> Rule:
    e = _Entry(raw, path, "rule", index, _RULE_REQUIRED, _RULE_OPTIONAL, names)
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        e.fail("'enabled' must be true or false")
    return Rule(
        id=e.text("id"),
        wall=e.wall(),
        when=e.expr("when"),
        score=e.expr("score"),
        evidence=e.template("evidence"),
        fixes=e.texts("fixes"),
        description=" ".join((e.text("description") or "").split()),
        enabled=enabled,
        source=path,
    )


def _parse_fix(raw: Any, path: Path, index: int, names: frozenset[str]) -> Fix:
    e = _Entry(raw, path, "fix", index, _FIX_REQUIRED, _FIX_OPTIONAL, names)
    applied_when = e.expr("applied_when")
    applied = e.template("applied")
    if applied is not None and applied_when is None:
        e.fail("'applied' needs 'applied_when' (the condition that shows it is applied)")
    return Fix(
        id=e.text("id"),
        wall=e.wall(),
        title=" ".join(e.text("title").split()),
        why=e.template("why"),
        config=e.text("config").strip("\n"),
        preconditions=tuple(" ".join(p.split()) for p in e.texts("preconditions")),
        pitfalls=tuple(" ".join(p.split()) for p in e.texts("pitfalls")),
        pytorch=e.text("pytorch"),
        requires=e.expr("requires"),
        applied_when=applied_when,
        applied=applied,
        after=e.texts("after"),
        source=path,
    )


def _parse_family(raw: Any, path: Path, index: int) -> GpuFamily:
    e = _Entry(raw, path, "gpu family", index, ("family", "match"), ())
    try:
        pattern = re.compile(e.text("match"), re.IGNORECASE)
    except re.error as err:
        e.fail(f"'match' is not a valid regex ({err})")
    return GpuFamily(e.text("family"), pattern, path)


_SCORING_KEYS = (
    "workflow",
    "meaningful",
    "dominant",
    "default_bound",
    "balanced_evidence",
    "time_share",
    "next_wall_min_share",
)


def _parse_scoring(raw: dict[str, tuple[Any, Path]], names: frozenset[str]) -> Scoring:
    def get(key: str) -> tuple[Any, Path]:
        if key not in raw:
            raise TraceError(None, f"scoring: missing {key!r} in the rule files")
        return raw[key]

    for key, (_, path) in raw.items():
        if key not in _SCORING_KEYS:
            raise TraceError(path, f"scoring: unknown setting {key!r}")
    workflow, path = get("workflow")
    if not isinstance(workflow, list) or sorted(workflow) != sorted(WALLS):
        raise TraceError(path, f"scoring: 'workflow' must list each of {', '.join(WALLS)} once")
    values = {}
    for key in ("meaningful", "dominant", "next_wall_min_share"):
        value, path = get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise TraceError(path, f"scoring: {key!r} must be a number in [0, 1]")
        values[key] = float(value)
    bound, path = get("default_bound")
    if bound not in WALLS:
        raise TraceError(path, f"scoring: 'default_bound' must be one of {', '.join(WALLS)}")
    text, path = get("balanced_evidence")
    try:
        balanced = Template.parse(" ".join(str(text).split()))
        _check_names(balanced.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'balanced_evidence': {e}") from None
    shares, path = get("time_share")
    if not isinstance(shares, dict) or sorted(shares) != sorted(WALLS):
        raise TraceError(path, f"scoring: 'time_share' must map each of {', '.join(WALLS)}")
    try:
        time_share = {w: Expr.parse(str(src)) for w, src in shares.items()}
        for expr in time_share.values():
            _check_names(expr.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'time_share': {e}") from None
    return Scoring(
        tuple(workflow),
        values["meaningful"],
        values["dominant"],
        bound,
        balanced,
        time_share,
        values["next_wall_min_share"],
    )


def _check_references(rs: RuleSet) -> None:
    for rule in rs.rules.values():
        for fix_id in rule.fixes:
            if fix_id not in rs.fixes:
                close = difflib.get_close_matches(fix_id, rs.fixes, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TraceError(rule.source, f"rule {rule.id!r}: unknown fix id {fix_id!r}{hint}")
    for fix in rs.fixes.values():
        for other in fix.after:
            if other not in rs.fixes:
                raise TraceError(fix.source, f"fix {fix.id!r}: unknown fix id {other!r} in 'after'")
    missing = [f for f in CONTRACT_FIX_IDS if f not in rs.fixes]
    if missing:
        raise TraceError(rs.folders[0], f"fix {missing[0]!r}: missing from the bundled fixes")


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class Verdict:
    classification: dict  # {"bound", "confidence", "scores": {wall: float}, "evidence": [str]}
    fixes: list[dict]  # contract fix objects, ordered, each also with "rule_ids" and "score"
    applied: list[str]  # what the trace shows is already applied
    next_wall: str | None


@dataclass(frozen=True)
class _Hit:
    rule: Rule
    score: float
    order: int  # definition order, the last tie-breaker


def evaluate(facts: dict, rules_dir: Path | None = None) -> Verdict:
    """Classify a run from its facts (mean metrics, GPU, ranks, communication by kind, cross-rank
    skew) and propose the fixes, in the workflow order memory -> communication -> host -> compute."""
    rs = load_rules(rules_dir)
    env = build_env(facts, rs)
    hits = _fire(rs, env)
    scores = {w: _combine(h.score for h in hits if h.rule.wall == w) for w in WALLS}
    bound, confidence = _bound(scores, rs.scoring)
    # Walls reported with evidence and fixes: the bound and any other wall that matters.
    shown = [w for w in rs.scoring.workflow if w == bound or scores[w] >= rs.scoring.meaningful]
    return Verdict(
        classification=_classification(hits, scores, bound, confidence, shown, rs, env),
        fixes=_propose(hits, shown, rs, env),
        applied=[_applied_sentence(f, env) for f in _by_workflow(rs) if _is_applied(f, env)],
        next_wall=_next_wall(scores, bound, rs.scoring, env),
    )


def _classification(
    hits: list[_Hit],
    scores: dict[str, float],
    bound: str,
    confidence: float,
    shown: list[str],
    rs: RuleSet,
    env: dict[str, Any],
) -> dict:
    """The contract's classification; evidence of the bound first, then workflow order."""
    workflow = rs.scoring.workflow
    hits = sorted(
        hits, key=lambda h: (h.rule.wall != bound, workflow.index(h.rule.wall), -h.score, h.order)
    )
    evidence = [h.rule.evidence.render(env) for h in hits if h.rule.wall in shown]
    if max(scores.values()) < rs.scoring.dominant:
        evidence.insert(0, rs.scoring.balanced_evidence.render(env))
    return {
        "bound": bound,
        "confidence": round(confidence, 3),
        "scores": {w: round(scores[w], 3) for w in WALLS},
        "evidence": [e for e in evidence if e],
        "rules": [{"id": h.rule.id, "wall": h.rule.wall, "score": round(h.score, 3)} for h in hits],
    }


def build_env(facts: dict, rs: RuleSet) -> dict[str, Any]:
    """The names conditions see: every measure (null when absent) plus the context names."""
    metrics = facts.get("metrics") or {}
    gpu = facts.get("gpu") or {}
    kinds = facts.get("comm_by_kind") or {}
    cross = facts.get("cross_rank") or {}
    env: dict[str, Any] = dict.fromkeys(known_names()) | dict(metrics)
    env |= {
        "gpu_family": gpu_family(gpu, rs.families),
        "gpu_name": gpu.get("name"),
        "gpu_chip": gpu.get("chip"),
        "gpu_sm_count": gpu.get("sm_count"),
        "gpu_memory_bytes": gpu.get("memory_bytes"),
        "rank_count": facts.get("rank_count") or len(facts.get("ranks") or []) or 1,
        "uses_cuda_graphs": bool(metrics.get("uses_cuda_graphs")),
        "comm_libraries": sorted({lib for k in kinds.values() for lib in k.get("libraries") or []}),
        "comm_kinds": sorted(kinds),
        "other_comm_kinds": sorted(k for k in kinds if k != "all_to_all"),
        "straggler_rank": cross.get("straggler_rank"),
        "step_time_skew_frac": cross.get("step_time_skew_frac"),
        "compute_skew_frac": cross.get("compute_skew_frac"),
    }
    for name, definition in rs.definitions.items():  # in order: each may use the ones before
        env[name] = definition.expr.value(env)
    return env


def gpu_family(gpu: dict | None, families: list[GpuFamily]) -> str:
    """First family whose pattern matches the GPU's name or chip; "unknown" otherwise."""
    text = " ".join(str(gpu.get(k) or "") for k in ("name", "chip")) if gpu else ""
    return next((f.family for f in families if text.strip() and f.match.search(text)), "unknown")


def _fire(rs: RuleSet, env: dict[str, Any]) -> list[_Hit]:
    hits = []
    for order, rule in enumerate(rs.rules.values()):
        if rule.enabled and rule.when.holds(env):
            score = rule.score.value(env)
            ok = isinstance(score, (int, float)) and not isinstance(score, bool)
            hits.append(_Hit(rule, min(max(float(score), 0.0), 1.0) if ok else 0.0, order))
    return hits


def _combine(scores: Iterable[float]) -> float:
    """Independent pieces of evidence for one wall: 1 - prod(1 - s) stays in [0, 1] and grows
    with every rule that fires without letting overlapping rules add past certainty."""
    return 1.0 - math.prod(1.0 - s for s in scores)


def _bound(scores: dict[str, float], scoring: Scoring) -> tuple[str, float]:
    ranked = sorted(scores, key=lambda w: (-scores[w], scoring.workflow.index(w)))
    top, second = scores[ranked[0]], scores[ranked[1]]
    if top <= 0:
        return scoring.default_bound, 0.0
    # High when the top wall is strong and clearly ahead; never above the top score itself.
    return ranked[0], min(max(top - 0.5 * second, 0.0), 1.0)


def _next_wall(
    scores: dict[str, float], bound: str, scoring: Scoring, env: Mapping[str, Any]
) -> str | None:
    """The wall the run hits once the bound is fixed: the strongest other wall that scores;
    else, before the last wall of the workflow, the wall with the largest share of what is
    left of the step once the bound's share is gone."""
    others = sorted((w for w in WALLS if w != bound), key=lambda w: -scores[w])
    if others and scores[others[0]] >= scoring.meaningful:
        return others[0]
    after = scoring.workflow[scoring.workflow.index(bound) + 1 :]
    scored = next((w for w in after if scores[w] > 0), None)
    if scored or not after:
        return scored
    shares = {w: scoring.time_share[w].value(env) for w in WALLS}
    if not all(isinstance(v, (int, float)) for v in shares.values()):
        return None
    rest = 1 - shares[bound]
    remaining = {
        w: shares[w] / rest
        for w in others
        if rest > 0 and shares[w] / rest >= scoring.next_wall_min_share
    }
    return max(remaining, key=remaining.__getitem__) if remaining else None


def _propose(hits: list[_Hit], shown: list[str], rs: RuleSet, env: dict[str, Any]) -> list[dict]:
    """Fixes of the reported walls, each placed where its strongest workflow-first rule puts it;
    fixes whose hardware requirement fails or that the trace shows applied are left out."""
    hits = sorted(hits, key=lambda h: (rs.scoring.workflow.index(h.rule.wall), -h.score, h.order))
    found: dict[str, dict] = {}
    for h in hits:
        if h.rule.wall not in shown:
            continue
        for fix_id in h.rule.fixes:
            entry = found.setdefault(fix_id, {"wall": h.rule.wall, "score": h.score, "rules": []})
            entry["score"] = max(entry["score"], h.score)
            entry["rules"].append(h.rule.id)
    out = []
    for fix_id, entry in found.items():
        fix = rs.fixes[fix_id]
        if (fix.requires is not None and not fix.requires.holds(env)) or _is_applied(fix, env):
            continue
        out.append(_fix_object(fix, entry, env))
    return _prerequisites_first(out, rs)


def _fix_object(fix: Fix, entry: dict, env: dict[str, Any]) -> dict:
    obj = {
        "id": fix.id,
        "wall": entry["wall"],
        "title": fix.title,
        "why": fix.why.render(env),
        "config": fix.config,
        "preconditions": list(fix.preconditions),
        "pitfalls": list(fix.pitfalls),
        "rule_ids": list(dict.fromkeys(entry["rules"])),
        "score": round(entry["score"], 3),
    }
    if fix.pytorch:
        obj["pytorch"] = " ".join(fix.pytorch.split())
    return obj


def _prerequisites_first(fixes: list[dict], rs: RuleSet) -> list[dict]:
    """A fix listed in another's ``after`` moves just ahead of it (remove host syncs before CUDA
    graphs: a sync inside a capture fails)."""
    ordered = list(fixes)
    for fix in fixes:
        for before in rs.fixes[fix["id"]].after:
            ids = [f["id"] for f in ordered]
            if before in ids and ids.index(before) > ids.index(fix["id"]):
                moved = ordered.pop(ids.index(before))
                ordered.insert(ids.index(fix["id"]), moved)
    return ordered


def _is_applied(fix: Fix, env: dict[str, Any]) -> bool:
    return fix.applied_when is not None and fix.applied_when.holds(env)


def _applied_sentence(fix: Fix, env: dict[str, Any]) -> str:
    return fix.applied.render(env) if fix.applied else f"{fix.title}: already applied"


def _by_workflow(rs: RuleSet) -> list[Fix]:
    return sorted(rs.fixes.values(), key=lambda f: rs.scoring.workflow.index(f.wall))


# ---------------------------------------------------------------------------------------------
# `traceclf rules` and `traceclf explain FIX_ID`


def list_rules(rules_dir: Path | None = None) -> None:
    """Print the rules and the fixes they can propose (rich tables, stdout)."""
    from rich.table import Table

    rs = load_rules(rules_dir)
    console = _console()
    rules = Table(
        title="Rules (a rule adds its score to its wall when its condition holds)",
        title_justify="left",
        show_lines=False,
    )
    rules.add_column("rule", no_wrap=True)
    rules.add_column("wall", no_wrap=True)
    for col, ratio in (("when", 3), ("score", 2), ("fixes", 2)):
        rules.add_column(col, overflow="fold", ratio=ratio)
    for rule in sorted(rs.rules.values(), key=lambda r: rs.scoring.workflow.index(r.wall)):
        when = rule.when.source if rule.enabled else f"(disabled) {rule.when.source}"
        rules.add_row(rule.id, rule.wall, when, rule.score.source, ", ".join(rule.fixes))
    fixes = Table(title="Fixes (traceclf explain FIX_ID shows one in full)", title_justify="left")
    for col in ("fix", "wall", "title", "requires", "applied when"):
        fixes.add_column(col, overflow="fold")
    for fix in _by_workflow(rs):
        fixes.add_row(
            fix.id,
            fix.wall,
            fix.title,
            fix.requires.source if fix.requires else "",
            fix.applied_when.source if fix.applied_when else "",
        )
    definitions = Table(title="Definitions (named expressions rules can use)", title_justify="left")
    for col in ("name", "expression"):
        definitions.add_column(col, overflow="fold")
    for d in rs.definitions.values():
        definitions.add_row(d.name, d.expr.source)
    console.print(rules)
    console.print(fixes)
    console.print(definitions)
    console.print("Rule files: " + ", ".join(str(f) for f in rs.folders))


def explain_fix(fix_id: str, rules_dir: Path | None = None) -> None:
    """Print one fix in full: why, config to paste, preconditions, pitfalls, what proposes it."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.text import Text

    rs = load_rules(rules_dir)
    fix = rs.fixes.get(fix_id)
    if fix is None:
        raise TraceError(
            None, f"unknown fix {fix_id!r}; valid fix ids: {', '.join(sorted(rs.fixes))}"
        )
    proposers = [r.id for r in rs.rules.values() if fix.id in r.fixes]
    parts: list[Any] = [
        Text(fix.why.source),
        Text(""),
        Syntax(fix.config, "python", theme="ansi_dark", word_wrap=True),
    ]
    for label, items in (("Preconditions", fix.preconditions), ("Pitfalls", fix.pitfalls)):
        if items:
            parts += [Text(""), Text(label, style="bold")] + [Text(f"• {i}") for i in items]
    extra = [
        ("Plain PyTorch", fix.pytorch and " ".join(fix.pytorch.split())),
        ("Proposed only when", fix.requires and fix.requires.source),
        ("Detected as applied when", fix.applied_when and fix.applied_when.source),
        ("Proposed by rules", ", ".join(proposers)),
    ]
    for label, value in extra:
        if value:
            parts += [Text(""), Text.assemble((f"{label}: ", "bold"), value)]
    title = f"{fix.title}  [{fix.id} · {fix.wall}]"
    _console().print(Panel(Group(*parts), title=title, title_align="left"))


def _console():
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # piped or saved: rich would assume 80 columns
        console.width = 120
    return console
