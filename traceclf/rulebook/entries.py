"""One entry of a rule file, validated into a typed object: a rule, a fix, a GPU family, a
or the scoring settings (definitions: rulebook/definitions.py). Every problem is a one-line ``TraceError`` naming the file
and the entry (``rule 'x': missing 'when'``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceclf.rulebook import stamp
from traceclf.rulebook.expr import Expr, ExprError, Template
from traceclf.rulebook.fixparts import (
    Pitfall,
    Precondition,
    Recovers,
    parse_pitfalls,
    parse_preconditions,
    parse_recovers,
)
from traceclf.support.errors import TraceError
from traceclf.support.regex import regex_problem

WALLS = ("memory", "communication", "host", "compute")


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
    premises: tuple[Precondition, ...]  # preconditions, some of which a capture can contradict
    pitfalls: tuple[Pitfall, ...]
    pytorch: str | None
    requires: Expr | None
    applied_when: Expr | None
    applied: Template | None
    after: tuple[str, ...]
    source: Path
    generic: str | None = None  # the advice for a loop that is not a DL framework's
    verify: Template | None = None  # what the next capture shows once the fix works
    config_when: tuple[tuple[Expr, str], ...] = ()  # config lines added when the expr holds
    recovers: Recovers | None = None


@dataclass(frozen=True)
class LinearPattern:
    """A case-insensitive regex run by polars' engine (Rust ``regex``: linear time, no
    look-around or back-references), so no GPU name can make a rule file's pattern hang the
    way a backtracking engine does on ``^([A-Z0-9]+|[A-Z0-9 ]+)*!``."""

    pattern: str

    def search(self, text: str) -> bool:
        active = stamp.ACTIVE  # (answers remembered with the rule set's stamp)
        known = active.match(self.pattern, text) if active is not None else None
        if known is not None:
            return known
        import polars as pl

        found = bool(pl.Series([text], dtype=pl.String).str.contains(f"(?i){self.pattern}")[0])
        if active is not None:
            active.remember(self.pattern, text, found)
        return found


MAX_PATTERN_CHARS = 2000


@dataclass(frozen=True)
class GpuFamily:
    family: str
    match: LinearPattern
    source: Path


@dataclass(frozen=True)
class HostLink:
    """A GPU's link to host memory (``host_links``) or to the other GPUs of its host
    (``peer_links``): its name and GB/s per direction."""

    name: str
    gbps: float
    match: LinearPattern
    source: Path


@dataclass(frozen=True)
class Scoring:
    workflow: tuple[str, ...]
    meaningful: float  # a wall at least this strong is reported and its fixes proposed
    noteworthy: float  # a wall at least this strong has its evidence reported (no fixes)
    dominant: float  # below this no wall dominates: the run is reported as balanced
    default_bound: str
    balanced_evidence: Template
    # Each wall's share of the step; when no later wall scores, the largest remaining share
    # names the wall the run will hit once the bound is fixed.
    time_share: dict[str, Expr]
    next_wall_min_share: float
    # Confidence = the bound's time share x how far the window can be trusted (docs/judgement.md)
    step_source_weight: dict[str, float]
    full_confidence_steps: int
    # When a fix's framework config (Megatron-Bridge, PyTorch) applies; else its generic advice
    framework_advice_when: Expr
    # One sentence per wall saying how much of the step the bound takes (the report's headline),
    # and HEADLINE_VARIANTS: the compute wall's when graph-level traced replays hide kernels
    headline: dict[str, Template]
    # When `traceclf compare` calls a change beyond noise or material (docs/api.md)
    comparison: ComparisonSettings


@dataclass(frozen=True)
class ComparisonSettings:
    noise_standard_errors: float  # a change beyond this many standard errors is beyond noise
    material_points: float  # a fraction of the step moving by this many points is material
    material_relative: float  # a count or size moving by this share of itself is material
    part_share: float  # a kernel, phase, idle cause or collective: this share of the step
    memory_share: float  # peak device memory moving by this share of the GPU's memory


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

    def names_of(self, key: str) -> tuple[str, ...]:
        """A list of names rules may use (measures, context names, thresholds, definitions)."""
        names = self.texts(key)
        try:
            check_names(frozenset(names), self.names)
        except ExprError as e:
            self.fail(f"{key!r}: {e}")
        return names

    def part(self, raw: Any, required: tuple[str, ...], optional: tuple[str, ...]) -> _Entry:
        """A mapping nested in this entry, parsed with the same names, failing under its label."""
        sub = _Entry(raw, self.path, self.kind, 0, required, optional, self.names)
        sub.label = self.label
        return sub

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
            check_names(parsed.names, self.names)
        except ExprError as e:
            self.fail(f"{key!r}: {e}")
        return parsed

    def template(self, key: str) -> Template | None:
        value = self.text(key)
        if value is None:
            return None
        try:
            parsed = Template.parse(" ".join(value.split()))
            check_names(parsed.names, self.names)
        except ExprError as e:
            self.fail(f"{key!r}: {e}")
        return parsed


def check_names(used: frozenset[str], known: frozenset[str]) -> None:
    for name in sorted(used - known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ExprError(f"unknown measure {name!r}{hint}")


_RULE_REQUIRED = ("id", "wall", "when", "score", "evidence")
_RULE_OPTIONAL = ("fixes", "description", "enabled")
_FIX_REQUIRED = ("id", "wall", "title", "why", "config")
_FIX_OPTIONAL = (
    "verify",
    "generic",
    "config_when",
    "preconditions",
    "pitfalls",
    "pytorch",
    "requires",
    "applied_when",
    "applied",
    "after",
    "recovers",
)


def parse_rule(raw: Any, path: Path, index: int, names: frozenset[str]) -> Rule:
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


def parse_fix(raw: Any, path: Path, index: int, names: frozenset[str]) -> Fix:
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
        premises=parse_preconditions(e),
        pitfalls=parse_pitfalls(e),
        pytorch=e.text("pytorch"),
        requires=e.expr("requires"),
        applied_when=applied_when,
        applied=applied,
        after=e.texts("after"),
        source=path,
        generic=_text_block(e, "generic"),
        verify=e.template("verify"),
        config_when=_config_when(e),
        recovers=parse_recovers(e),
    )


def _text_block(e: _Entry, key: str) -> str | None:
    text = e.text(key)
    return text.strip("\n") if text else None


def _config_when(e: _Entry) -> tuple[tuple[Expr, str], ...]:
    """``config_when: [{when: expr, config: lines}]``: config lines that apply only when the
    trace shows what they need (delay_wgrad_compute needs a backward pass)."""
    raw = e.raw.get("config_when") or []
    if not isinstance(raw, list):
        e.fail("'config_when' must be a list of {when, config}")
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"when", "config"}:
            e.fail("'config_when' entries need exactly 'when' and 'config'")
        if not isinstance(item["config"], str) or not isinstance(item["when"], (str, bool)):
            e.fail("'config_when': 'when' is an expression and 'config' text")
        try:
            expr = Expr.parse(str(item["when"]))
            check_names(expr.names, e.names)
        except ExprError as err:
            e.fail(f"'config_when': {err}")
        out.append((expr, item["config"].strip("\n")))
    return tuple(out)


def _linear_pattern(e: _Entry) -> LinearPattern:
    source = e.text("match")
    if len(source) > MAX_PATTERN_CHARS:
        e.fail(f"'match' is longer than {MAX_PATTERN_CHARS} characters")
    if not stamp.CHECKING.get():  # a stamped rule set: checked when it was stamped
        return LinearPattern(source)
    import polars as pl

    try:
        pl.Series([""]).str.contains(f"(?i){source}")
    except pl.exceptions.PolarsError as err:
        e.fail(f"'match' is not a valid regex for the linear-time engine ({regex_problem(err)})")
    return LinearPattern(source)


def parse_family(raw: Any, path: Path, index: int) -> GpuFamily:
    e = _Entry(raw, path, "gpu family", index, ("family", "match"), ())
    return GpuFamily(e.text("family"), _linear_pattern(e), path)


def parse_host_link(raw: Any, path: Path, index: int, kind: str = "host link") -> HostLink:
    e = _Entry(raw, path, kind, index, ("link", "gbps", "match"), ())
    pattern = _linear_pattern(e)
    gbps = raw["gbps"]
    if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not 0 < gbps < 1e5:
        e.fail("'gbps' must be a positive number (GB/s per direction)")
    return HostLink(e.text("link"), float(gbps), pattern, path)


_SCORING_KEYS = (
    "workflow",
    "meaningful",
    "noteworthy",
    "dominant",
    "default_bound",
    "balanced_evidence",
    "time_share",
    "next_wall_min_share",
    "step_source_weight",
    "full_confidence_steps",
    "framework_advice_when",
    "headline",
    "comparison",
)
COMPARISON_SHARES = ("material_points", "material_relative", "part_share", "memory_share")
# Headlines beside one per wall: compute's when graph-level tracing hides the replays' kernels
# (the judge picks it when graph_unresolved_frac > 0: what runs inside them is unknown)
HEADLINE_VARIANTS = ("compute_graph_level",)


def parse_scoring(raw: dict[str, tuple[Any, Path]], names: frozenset[str]) -> Scoring:
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
    for key in ("meaningful", "noteworthy", "dominant", "next_wall_min_share"):
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
        check_names(balanced.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'balanced_evidence': {e}") from None
    shares, path = get("time_share")
    if not isinstance(shares, dict) or sorted(shares) != sorted(WALLS):
        raise TraceError(path, f"scoring: 'time_share' must map each of {', '.join(WALLS)}")
    try:
        time_share = {w: Expr.parse(str(src)) for w, src in shares.items()}
        for expr in time_share.values():
            check_names(expr.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'time_share': {e}") from None
    weights, path = get("step_source_weight")
    if not isinstance(weights, dict) or not all(
        isinstance(k, str)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and 0 <= v <= 1
        for k, v in weights.items()
    ):
        raise TraceError(path, "scoring: 'step_source_weight' must map step sources to [0, 1]")
    steps, path = get("full_confidence_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
        raise TraceError(path, "scoring: 'full_confidence_steps' must be an integer in [1, 1000]")
    advice, path = get("framework_advice_when")
    try:
        framework = Expr.parse(str(advice))
        check_names(framework.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'framework_advice_when': {e}") from None
    lines, path = get("headline")
    if (
        not isinstance(lines, dict)
        or not set(WALLS) <= set(lines)
        or not set(lines) <= {*WALLS, *HEADLINE_VARIANTS}
    ):
        raise TraceError(
            path,
            f"scoring: 'headline' must map each of {', '.join(WALLS)} "
            f"(and may set {', '.join(HEADLINE_VARIANTS)})",
        )
    try:
        headline = {w: Template.parse(" ".join(str(t).split())) for w, t in lines.items()}
        for template in headline.values():
            check_names(template.names, names)
    except ExprError as e:
        raise TraceError(path, f"scoring: 'headline': {e}") from None
    comparison = parse_comparison(*get("comparison"))
    return Scoring(
        tuple(workflow),
        values["meaningful"],
        values["noteworthy"],
        values["dominant"],
        bound,
        balanced,
        time_share,
        values["next_wall_min_share"],
        {k: float(v) for k, v in weights.items()},
        steps,
        framework,
        headline,
        comparison,
    )


def parse_comparison(raw: Any, path: Path) -> ComparisonSettings:
    """``scoring.comparison``: the noise band in standard errors, and the shares past which a
    change is material."""
    keys = ("noise_standard_errors", *COMPARISON_SHARES)
    if not isinstance(raw, dict) or sorted(raw) != sorted(keys):
        raise TraceError(path, f"scoring: 'comparison' must set each of {', '.join(keys)}")
    for key, value in raw.items():
        top = 10 if key == "noise_standard_errors" else 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= top:
            raise TraceError(path, f"scoring: comparison {key!r} must be a number in [0, {top}]")
    return ComparisonSettings(**{k: float(v) for k, v in raw.items()})
