"""Rule folders into one :class:`RuleSet`: the bundled ``rules/*.yaml``, then a ``--rules``
folder merged over it, every entry validated into typed objects with a one-line error naming
the file and the entry.

Kinds of entries (docs/rules.md): ``rules`` (a condition on the measures, a score for one
wall, an evidence sentence, the fix ids it proposes), ``fixes`` (what to change, when it
applies, how to tell it is already applied), ``gpu_families`` (GPU name/chip -> family),
``host_links``, ``peer_links`` (GPU name/chip -> the link to the other GPUs of its host),
``communicators`` (what a communicator's collectives say about its parallel dimension, NCCL's
bandwidth formulas), ``scoring`` (workflow order and score thresholds), ``thresholds`` (the numbers
that decide verdicts, stragglers, abstentions and fixes), ``definitions`` (named expressions) and the ``taxonomy`` of kernels, CUDA calls and NVTX ranges (rules/kernels.yaml),
returned as plain tables (:mod:`traceclf.model.taxonomy` makes them polars expressions).

The names rules may use (every measure and context name) come from the caller
(:func:`traceclf.judge.vocabulary.load_rules`): rule files are data, below the measures in the
layer order, and a rule stamp that vouches for the names spares a cached re-analysis their
import.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from traceclf.rulebook import stamp
from traceclf.rulebook.capturequality import CaptureQuality, parse_capture
from traceclf.rulebook.comm_rules import CommRules, parse_communicators
from traceclf.rulebook.definitions import Definition, parse_definitions
from traceclf.rulebook.entries import (
    Fix,
    GpuFamily,
    HostLink,
    Rule,
    Scoring,
    parse_family,
    parse_fix,
    parse_host_link,
    parse_rule,
    parse_scoring,
)
from traceclf.rulebook.rulefiles import bundled_rules_dir, yaml_files
from traceclf.rulebook.taxonomy_tables import TaxonomyTables, parse_taxonomy
from traceclf.rulebook.thresholds import parse_thresholds
from traceclf.rulebook.yamlfile import (
    MAX_RULE_VALUES,
    check_folder_size,
    read_text,
    read_yaml,
    section,
)
from traceclf.support.errors import Problems, TraceError

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


@dataclass
class RuleSet:
    rules: dict[str, Rule]
    fixes: dict[str, Fix]
    families: list[GpuFamily]
    scoring: Scoring
    definitions: dict[str, Definition]
    folders: list[Path]
    taxonomy: TaxonomyTables
    host_links: list[HostLink] = field(default_factory=list)
    # the link between a GPU and the other GPUs of its host (NVLink, PCIe), matched like
    # host_links
    peer_links: list[HostLink] = field(default_factory=list)
    communicators: CommRules = field(default_factory=CommRules)
    # the measures and context names the rules were checked against (the judge's environment)
    names: frozenset[str] = frozenset()
    # every number that decides a verdict, a straggler, an abstention or a fix, by name
    thresholds: dict[str, int | float] = field(default_factory=dict)
    capture: CaptureQuality = field(default_factory=CaptureQuality)


def load_rules(
    rules_dir: Path | str | None,
    remember: Path | None,
    names: Callable[[], frozenset[str]],
) -> RuleSet:
    """The bundled rule set, with ``rules_dir`` (if given) merged over it: an entry with the id
    of a bundled one replaces it; conditions may use ``names()`` (asked only when no stamp
    vouches for the rule set). Raises TraceError naming the file for any problem.

    Read once per process while the files are unchanged (an analysis needs the rules for its
    checks, its taxonomy and its verdict): callers share the returned RuleSet, read-only. With
    ``remember`` (a cache root), a rule set that passed its checks is stamped there, and a
    stamped one is read without checking its patterns again (:mod:`traceclf.rulebook.stamp`)."""
    folders = [bundled_rules_dir()]
    if rules_dir is not None:
        user = Path(rules_dir)
        if not user.is_dir():
            raise TraceError(user, "rules folder not found")
        if not yaml_files(user):
            raise TraceError(user, "no rule files (*.yaml) in this folder")
        folders.append(user)
    files = [yaml_files(folder) for folder in folders]
    key = tuple((str(p), *_identity(p)) for layer in files for p in layer)
    if key not in _LOADED:
        if len(_LOADED) >= 8:  # a long-lived process with many --rules folders
            _LOADED.clear()
        _LOADED[key] = _load(folders, files, remember, names)
    return _LOADED[key]


_LOADED: dict[tuple, RuleSet] = {}


def _identity(path: Path) -> tuple[int, ...]:
    try:
        st = path.stat()
    except OSError:
        return ()  # reading it fails with the reason
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _load(
    folders: list[Path],
    layers: list[list[Path]],
    remember: Path | None,
    names: Callable[[], frozenset[str]],
) -> RuleSet:
    problems = Problems()  # every faulty file, then every faulty entry, at once
    texts: list[list[tuple[Path, str]]] = [[] for _ in layers]
    for layer, read in zip(layers, texts, strict=True):
        for path in layer:
            with problems.entry():
                read.append((path, read_text(path)))  # (once each)
    problems.check()
    for folder, layer in zip(folders, texts, strict=True):
        check_folder_size(folder, layer)
    docs: list[list[tuple[Path, dict]]] = [[] for _ in folders]
    for folder, layer, parsed in zip(folders, texts, docs, strict=True):
        values = [MAX_RULE_VALUES]  # what the folder's files may still hold, shared by them
        for path, text in layer:
            with problems.entry():
                parsed.append((path, read_yaml(path, text, values, folder)))
    problems.check()
    stamped = None
    if remember is not None:
        with contextlib.suppress(OSError):
            stamped = stamp.Stamp(remember, stamp.key([f for layer in texts for f in layer]))
    vouched = stamped.names if stamped is not None else None
    known = names() if vouched is None else vouched
    with stamp.checked(vouched is None):
        ruleset = _parse(folders, docs, known)
    if stamped is not None:
        if vouched is None:
            stamped.write(known)
        stamp.ACTIVE = stamped
    return ruleset


def bundled_taxonomy() -> TaxonomyTables:
    """The taxonomy of the bundled rule files alone (API users who pass none): no rule is
    parsed, so no measure need be known."""
    files = yaml_files(bundled_rules_dir())
    key = tuple((str(p), *_identity(p)) for p in files)
    if key not in _TAXONOMIES:
        _TAXONOMIES.clear()
        _TAXONOMIES[key] = parse_taxonomy([[(path, read_yaml(path)) for path in files]])
    return _TAXONOMIES[key]


_TAXONOMIES: dict[tuple, TaxonomyTables] = {}


def bundled_thresholds() -> dict[str, int | float]:
    """The thresholds of the bundled rule files alone (API users who pass none): no rule is
    parsed, so no measure need be known."""
    files = yaml_files(bundled_rules_dir())
    key = tuple((str(p), *_identity(p)) for p in files)
    if key not in _THRESHOLDS:
        _THRESHOLDS.clear()
        problems = Problems()
        thresholds = parse_thresholds(
            [[(path, read_yaml(path)) for path in files]], frozenset(), problems
        )
        problems.check()
        _THRESHOLDS[key] = thresholds
    return _THRESHOLDS[key]


_THRESHOLDS: dict[tuple, dict[str, int | float]] = {}


def _parse(
    folders: list[Path], docs: list[list[tuple[Path, dict]]], known: frozenset[str]
) -> RuleSet:
    """The rule set, checked in stages, each reporting all its problems at once (a later stage
    would report what an earlier one's faults cause: a rule "using an unknown measure" whose
    threshold was the faulty entry): thresholds and definitions, then every entry, then the
    references between entries."""
    problems = Problems()
    thresholds = parse_thresholds(docs, known, problems)
    definitions = parse_definitions(docs, known | frozenset(thresholds), problems)
    problems.check()
    names = known | frozenset(thresholds) | frozenset(definitions)
    rules: dict[str, Rule] = {}
    fixes: dict[str, Fix] = {}
    families: list[GpuFamily] = []
    host_links: list[HostLink] = []
    peer_links: list[HostLink] = []
    scoring_raw: dict[str, tuple[Any, Path]] = {}
    for files in docs:
        layer = _parse_layer(files, names, problems)
        rules |= layer["rules"]
        for rule_id, path in layer["disabled"].items():
            with problems.entry():
                if rule_id not in rules:
                    raise TraceError(path, f"rule {rule_id!r}: disabled, but no such rule")
                rules[rule_id] = replace(rules[rule_id], enabled=False)
        fixes |= layer["fixes"]
        # A later folder's families are tried first, so a user can refine the bundled ones.
        taken = {f.family for f in layer["families"]}
        families = layer["families"] + [f for f in families if f.family not in taken]
        host_links = layer["host_links"] + host_links
        peer_links = layer["peer_links"] + peer_links
        scoring_raw |= layer["scoring"]
    with problems.entry():
        scoring = parse_scoring(scoring_raw, names)
    with problems.entry():
        taxonomy = parse_taxonomy(docs)
    # (a reference to a fix whose entry is faulty is that entry's problem, not one more)
    broken = {fix_id for files in docs for fix_id in _fix_ids(files)} - set(fixes)
    _check_references(rules, fixes, broken, folders[0], problems)
    problems.check()
    ruleset = RuleSet(
        rules,
        fixes,
        families,
        scoring,
        definitions,
        folders,
        taxonomy,
        host_links,
        peer_links,
        parse_communicators(docs),
        names=known,
        thresholds=thresholds,
        capture=parse_capture(docs, names),
    )
    return ruleset


def _parse_layer(
    files: list[tuple[Path, dict]], names: frozenset[str], problems: Problems
) -> dict[str, Any]:
    """One folder's entries; a faulty one goes to ``problems`` and the rest are still read."""
    out: dict[str, Any] = {
        "rules": {},
        "disabled": {},
        "fixes": {},
        "families": [],
        "host_links": [],
        "peer_links": [],
        "scoring": {},
    }
    for path, doc in files:
        for i, raw in enumerate(_entries(doc, "rules", path, problems)):
            if _is_disable_stub(raw):  # `{id: x, enabled: false}` turns a bundled rule off
                out["disabled"][raw["id"]] = path
                continue
            with problems.entry():
                _add_unique(out["rules"], parse_rule(raw, path, i, names), path, "rule")
        for i, raw in enumerate(_entries(doc, "fixes", path, problems)):
            with problems.entry():
                _add_unique(out["fixes"], parse_fix(raw, path, i, names), path, "fix")
        for i, raw in enumerate(_entries(doc, "host_links", path, problems)):
            with problems.entry():
                out["host_links"].append(parse_host_link(raw, path, i))
        for i, raw in enumerate(_entries(doc, "peer_links", path, problems)):
            with problems.entry():
                out["peer_links"].append(parse_host_link(raw, path, i, "peer link"))
        for i, raw in enumerate(_entries(doc, "gpu_families", path, problems)):
            with problems.entry():
                out["families"].append(parse_family(raw, path, i))
        with problems.entry():
            scoring = section(doc, "scoring", path, "a mapping of settings") or {}
            out["scoring"] |= {k: (v, path) for k, v in scoring.items()}
    return out


def _is_disable_stub(raw: Any) -> bool:
    return (
        isinstance(raw, dict)
        and set(raw) == {"id", "enabled"}
        and raw["enabled"] is False
        and isinstance(raw["id"], str)
    )


def _entries(doc: dict, key: str, path: Path, problems: Problems) -> list:
    value = doc.get(key) or []
    with problems.entry():
        if not isinstance(value, list):
            raise TraceError(path, f"{key}: must be a list of entries")
    return value if isinstance(value, list) else []


def _add_unique(into: dict, item: Rule | Fix, path: Path, kind: str) -> None:
    if item.id in into:
        raise TraceError(path, f"{kind} {item.id!r}: defined twice in {path.parent.name}/")
    into[item.id] = item


def _fix_ids(files: list[tuple[Path, dict]]) -> list[str]:
    """The ids the fix entries of ``files`` give themselves, parsed or not."""
    raws = [raw for _path, doc in files for raw in doc.get("fixes") or [] if isinstance(raw, dict)]
    return [raw["id"] for raw in raws if isinstance(raw.get("id"), str)]


def _check_references(
    rules: dict[str, Rule],
    fixes: dict[str, Fix],
    broken: set[str],
    bundled: Path,
    problems: Problems,
) -> None:
    """Fix ids that rules and fixes name but no fix entry defines (``broken``: defined by an
    entry that is itself faulty, already reported), and bundled fixes a layer lost."""
    for rule in rules.values():
        for fix_id in rule.fixes:
            if fix_id not in fixes and fix_id not in broken:
                close = difflib.get_close_matches(fix_id, fixes, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.add(
                    TraceError(rule.source, f"rule {rule.id!r}: unknown fix id {fix_id!r}{hint}")
                )
    for fix in fixes.values():
        for other in fix.after:
            if other not in fixes and other not in broken:
                problems.add(
                    TraceError(fix.source, f"fix {fix.id!r}: unknown fix id {other!r} in 'after'")
                )
    for missing in (f for f in CONTRACT_FIX_IDS if f not in fixes and f not in broken):
        problems.add(TraceError(bundled, f"fix {missing!r}: missing from the bundled fixes"))
