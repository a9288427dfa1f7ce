"""`traceclf rules`, `traceclf explain FIX_ID` and `traceclf kernels NAME...`: the rule set, one
fix, and which taxonomy entry classifies a kernel name, as rich console output."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path
from typing import Any

from traceclf.judge.engine import by_workflow
from traceclf.judge.vocabulary import load_rules
from traceclf.rulebook.entries import Fix
from traceclf.rulebook.expr import Expr, Template
from traceclf.rulebook.fixparts import Pitfall, Precondition
from traceclf.support.errors import TraceError
from traceclf.support.escape import for_terminal, visible
from traceclf.support.units import plural


def list_rules(rules_dir: Path | None = None) -> None:
    """Print the rules and the fixes they can propose (rich tables, stdout)."""
    from rich.table import Table
    from rich.text import Text

    rs = load_rules(rules_dir)
    console = _console()
    rules = Table(
        title="Rules (a rule adds its score to its wall when its condition holds)",
        title_justify="left",
        show_lines=False,
    )
    # (each rule's id over what it finds: the id whole on its own line, the words wrapped)
    widest = max((len(r.id) for r in rs.rules.values()), default=4)
    rules.add_column("rule", min_width=min(widest, 40), ratio=3, overflow="fold")
    rules.add_column("wall", no_wrap=True)
    for col, ratio in (("when", 3), ("score", 2), ("fixes", 2)):
        rules.add_column(col, overflow="fold", ratio=ratio)
    for rule in sorted(rs.rules.values(), key=lambda r: rs.scoring.workflow.index(r.wall)):
        when = rule.when.source if rule.enabled else f"(disabled) {rule.when.source}"
        named = Text.assemble(
            for_terminal(rule.id, "bold"),
            *(("\n", for_terminal(rule.description)) if rule.description else ()),
        )
        cells = (rule.wall, when, rule.score.source, ", ".join(rule.fixes))
        rules.add_row(named, *map(for_terminal, cells))
    fixes = Table(title="Fixes (traceclf explain FIX_ID shows one in full)", title_justify="left")
    for col in ("fix", "wall", "title", "requires", "applied when"):
        fixes.add_column(col, overflow="fold")
    for fix in by_workflow(rs):
        cells = (
            fix.id,
            fix.wall,
            fix.title,
            fix.requires.source if fix.requires else "",
            fix.applied_when.source if fix.applied_when else "",
        )
        fixes.add_row(*map(for_terminal, cells))
    definitions = Table(title="Definitions (named expressions rules can use)", title_justify="left")
    for col in ("name", "expression"):
        definitions.add_column(col, overflow="fold")
    for d in rs.definitions.values():
        definitions.add_row(for_terminal(d.name), for_terminal(d.expr.source))
    thresholds = Table(title="Thresholds", title_justify="left")
    for col in ("name", "value"):
        thresholds.add_column(col, overflow="fold")
    for name, value in rs.thresholds.items():
        thresholds.add_row(for_terminal(name), for_terminal(f"{value:g}"))
    console.print(rules)
    console.print(fixes)
    console.print(definitions)
    console.print(thresholds)
    console.print(for_terminal("Rule files: " + ", ".join(str(f) for f in rs.folders)))


def explain_fix(fix_id: str, rules_dir: Path | None = None) -> None:
    """Print one fix in full: why, config to paste, preconditions, pitfalls, its gain ceiling
    and what it assumes, what proposes it. Laid out like a fix of ``analyze`` (no box around
    it: a border on every line of the config would be copied with it)."""
    from rich.console import Group
    from rich.padding import Padding
    from rich.text import Text

    from traceclf.render.code_wrap import CodeBlock
    from traceclf.render.fit import hanging

    rs = load_rules(rules_dir)
    fix = rs.fixes[find_fix_id(fix_id, rs.fixes)]
    proposers = [r.id for r in rs.rules.values() if fix.id in r.fixes]

    def indented(renderable: Any) -> Padding:
        return Padding(renderable, (0, 0, 0, INDENT))

    parts: list[Any] = [
        for_terminal(f"{fix.title}  [{fix.id} · {fix.wall}]", "bold"),  # Text: never markup
        indented(for_terminal(template_without_trace(fix.why))),
        Text(""),
        CodeBlock(visible(_config(fix), multiline=True), indent=INDENT),
    ]
    conditional = (("Preconditions", fix.premises), ("Pitfalls", fix.pitfalls))
    for label, items in ((label, [_said_when(i) for i in said]) for label, said in conditional):
        if items:
            parts += [
                Text(""),
                indented(Text(label, style="bold")),
                indented(hanging([("•", for_terminal(i)) for i in items])),
            ]
    extra = [
        ("Plain PyTorch", fix.pytorch and " ".join(fix.pytorch.split())),
        ("Gain ceiling", _ceiling(fix)),
        ("It assumes", fix.recovers and template_without_trace(fix.recovers.assumes)),
        ("Proposed only when", fix.requires and fix.requires.source),
        ("Detected as applied when", fix.applied_when and fix.applied_when.source),
        ("Proposed by rules", ", ".join(proposers)),
    ]
    for label, value in extra:
        if value:
            parts += [
                Text(""),
                indented(Text.assemble((f"{label}: ", "bold"), for_terminal(value))),
            ]
    _console().print(Group(*parts), crop=False)  # a config line that cannot break: whole


def _config(fix: Fix) -> str:
    """The config to paste, with the lines added when a condition of the trace holds, each
    after a comment saying which (``config_when``)."""
    added = [f"# when {when.source}:\n{lines.strip()}" for when, lines in fix.config_when]
    return "\n".join([fix.config.strip(), *added]).strip()


def _ceiling(fix: Fix) -> str | None:
    """What a fix's ceiling is made of, before any trace fills in the numbers."""
    r = fix.recovers
    if r is None:
        return None
    what = {
        "step": f"{r.frac.source if r.frac else '?'} of the step",
        "sample": f"samples per second × {r.gain.source if r.gain else '?'}",
        "gpu": f"{r.frac.source if r.frac else '?'} of the step, per GPU × "
        f"{r.gain.source if r.gain else '?'}",
    }[r.unit]
    parts = [f"{what}, from {' + '.join(r.classes)}"]
    if r.floor_ms is not None:
        parts.append(f"the step no shorter than {r.floor_ms.source} ms")
    if r.multiplier is not None:
        never = r.multiplier.source.strip() == "False"
        parts.append(
            "no throughput multiplier"
            if never
            else f"a throughput multiplier only when {r.multiplier.source}"
        )
    if r.bound_by:
        parts.append(f"bounded by {', '.join(r.bound_by)}")
    return "; ".join(parts)


def explain_kernels(names: list[str], rules_dir: Path | None = None) -> None:
    """For each kernel name: its family and the entry that decides it (name, file, pattern),
    the entries further down that match it too (first match wins, so they do not count), and,
    for a communication kernel, its library and collective kind as the name says them."""
    import polars as pl

    from traceclf.model.taxonomy import Taxonomy

    taxonomy = Taxonomy.of(load_rules(rules_dir).taxonomy)
    classified = taxonomy.classify(pl.DataFrame({"name": names}, schema={"name": pl.String}))
    labels = dict(zip(classified["name"].to_list(), classified.iter_rows(named=True), strict=True))
    console = _console()
    for i, name in enumerate(names):
        if i:
            console.print()
        console.print(for_terminal(name, "bold"))
        matches = taxonomy.family_patterns(name)
        if not matches:
            console.print(for_terminal("  family other: no entry of the taxonomy matches it"))
            continue
        first, *rest = matches
        console.print(for_terminal(f"  family {first.family}, by entry {first.name!r}"))
        console.print(for_terminal(f"    match {first.pattern!r}  ({first.source})"))
        row = labels[name]
        if row["is_comm"]:
            console.print(
                for_terminal(
                    f"  library {row['comm_library'] or 'unknown'}, collective kind "
                    f"{row['comm_kind']} (from the name; NVTX ranges around the launch may "
                    "refine the kind)"
                )
            )
        for other in rest:
            console.print(
                for_terminal(f"  would also match {other.name!r} ({other.family}), tried later")
            )


INDENT = 3  # a fix's text under its title, as in `analyze`
FIELD = "\x00"  # marks a field's words while a template is rendered without a trace
ASIDE = re.compile(r"\s*\(\x00[^\x00]*\x00\)")  # a parenthesis holding one field only
# How a template's fields read when there is no trace to fill them from (`explain`).
PLACEHOLDERS = {
    "gpu_name": "your GPU",
    "gpu_family": "supported",
    "rank_count": "N",
    "straggler_rank": "the slowest rank",
}


def template_without_trace(template: Template) -> str:
    """``template`` rendered with words instead of numbers. A field that is all a parenthesis
    holds ("(``{gpu_name}``)", "(``{idle_top_nvtx}``)": the trace's own value, an aside) is left
    out with its parentheses; other fields read as :data:`PLACEHOLDERS` says, else as
    ``‹name›`` (filled in from the trace when the fix is proposed)."""
    out = []
    for part in template.parts:
        if isinstance(part, str):
            out.append(part.replace(FIELD, ""))  # (the marker below never comes from a file)
            continue
        expr = part[0]
        names = sorted(expr.names)
        source, unit = _unwrapped(expr)
        if len(names) == 1 and names[0] in PLACEHOLDERS and source == names[0]:
            word = PLACEHOLDERS[names[0]]
        else:
            word = f"‹{source}›{unit}"
        out.append(f"{FIELD}{word}{FIELD}")
    text = ASIDE.sub("", "".join(out)).replace(FIELD, "")
    return " ".join(text.split())


def _unwrapped(expr: Expr) -> tuple[str, str]:
    """A field's expression without the function that gives it its unit, and that unit:
    ms(x) and count(n, "noun") read as "‹x› ms" and "‹n› nouns" without the trace's values."""
    node, source = expr.tree.body, expr.source
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return source, ""
    inner = ast.get_source_segment(source, node.args[0]) if node.args else None
    if node.func.id == "ms" and len(node.args) == 1 and inner:
        return inner, " ms"
    noun = node.args[1] if len(node.args) == 2 else None
    if node.func.id == "count" and inner and isinstance(noun, ast.Constant):
        return inner, f" {plural(str(noun.value))}"
    return source, ""


def find_fix_id(asked: str, fixes: dict) -> str:
    """The fix id meant by ``asked``: exact, else ignoring case and ``_``/``-``; otherwise a
    TraceError that suggests the closest ids."""
    if asked in fixes:
        return asked
    normal = {_normal(k): k for k in fixes}
    if _normal(asked) in normal:
        return normal[_normal(asked)]
    close = difflib.get_close_matches(_normal(asked), list(normal), n=3, cutoff=0.6)
    hint = (
        f"did you mean {' or '.join(normal[c] for c in close)}?"
        if close
        else f"valid fix ids: {', '.join(sorted(fixes))}"
    )
    raise TraceError(None, f"unknown fix {asked!r}; {hint} (traceclf rules lists them all)")


def _normal(fix_id: str) -> str:
    return fix_id.strip().lower().replace("_", "-")


def _console():
    from traceclf.render.fit import new_console

    return new_console()


def _said_when(item: Precondition | Pitfall) -> str:
    """A premise or pitfall as ``traceclf rules --explain`` lists it: with the condition under
    which a report says it."""
    return item.text if item.when is None else f"{item.text} (said when {item.when.source})"
