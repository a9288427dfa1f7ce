"""Rule files: read ``rules/*.yaml`` (bundled, then a ``--rules`` folder merged over it) and
validate every entry into typed objects, with a one-line error naming the file and the entry.

Four kinds of entries (docs/rules.md): ``rules`` (a condition on the measures, a score for one
wall, an evidence sentence, the fix ids it proposes), ``fixes`` (what to change, when it
applies, how to tell it is already applied), ``gpu_families`` (GPU name/chip -> family),
``scoring`` (workflow order and thresholds), ``definitions`` (named expressions) and the
``taxonomy`` of kernels, CUDA calls and NVTX ranges (rules/kernels.yaml).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import stat
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from traceclf.model.taxonomy import Taxonomy
from traceclf.rulebook import stamp
from traceclf.rulebook.entries import (
    Definition,
    Fix,
    GpuFamily,
    HostLink,
    Rule,
    Scoring,
    parse_definitions,
    parse_family,
    parse_fix,
    parse_host_link,
    parse_rule,
    parse_scoring,
)
from traceclf.rulebook.taxonomy_tables import parse_taxonomy
from traceclf.support.errors import TraceError

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
    "dp_tp_exposed_frac": "share of the step in all-reduce, reduce-scatter, all-gather, broadcast "
    "and reduce kernels with no compute running (DP/TP collectives)",
    "straggler_rank": "rank with the most compute per step among like ranks (null with one "
    "rank, unlike ranks, ranks that share a GPU, or a skew within the noise)",
    "step_time_skew_frac": "spread of step time across like ranks, as a fraction of the mean",
    "compute_skew_frac": "spread of compute time per step across like ranks, as a fraction",
    "comm_wait_frac": "share of matched collective time spent waiting for the last rank "
    "(duration minus the shortest participant's; null without matched collectives)",
    "comm_transfer_frac": "share of matched collective time that is transfer (shortest "
    "participant's duration)",
    "last_arriver_rank": "rank that starts matched collectives last most often",
    "training_loop": 'capture: "training", "forward_only", "not_a_loop" or "unknown"',
    "ranks_share_gpu": "capture: two or more ranks ran on one GPU (time-slicing it)",
    "moe_evidence": "capture: kernels or NVTX ranges of mixture-of-experts routing (taxonomy moe)",
    "gpu_assignment": 'capture: "own" (a GPU per rank), "shared" or "unknown" (ranks report one '
    "device and the export cannot say whether it is one GPU)",
    "graph_trace_mode": 'capture: CUDA-graph tracing, "graph", "node" or "none"',
    "cuda_api_traced": "capture: the CUDA API was traced on every rank (the export has "
    "CUPTI_ACTIVITY_KIND_RUNTIME rows): idle causes and launch counts are known",
    "steps_used": "steady-state steps in the window",
    "step_source": 'how steps were found: "nvtx", "graph", "pattern", "mixed" or "none"',
    "idle_top_nvtx": "the NVTX range the host was in for the most idle GPU time (null: none)",
    "idle_top_activity": "what that range was doing per the taxonomy (compile, data, mpi, ...)",
    "idle_top_nvtx_frac": "the share of the step that range covers while the GPU idles",
    "link_name": "the GPU's link to host memory (hardware.yaml host_links), e.g. PCIe Gen5 x16",
    "link_gbps": "that link's bandwidth per direction in GB/s (null for an unknown GPU)",
}

# Limits on rule files (docs/security.md): a rule file is data, and no rule file may exhaust
# the machine. The bundled files are ~25 KB, 8 levels deep, ~30,000 characters expanded.
MAX_RULE_FILE_BYTES = 1 << 20
MAX_RULE_FILES = 200  # per folder
MAX_YAML_DEPTH = 32
# Characters (scalars) plus nodes once every alias is expanded: bounds whatever walks or
# prints a document, whatever its aliases multiply ("billion laughs").
MAX_YAML_EXPANDED = 4_000_000
# libyaml's parser and composer when PyYAML has them (10-50x faster), else pure Python.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TOP_KEYS = (
    "rules",
    "fixes",
    "definitions",
    "gpu_families",
    "host_links",
    "scoring",
    "taxonomy",
)


@dataclass
class RuleSet:
    rules: dict[str, Rule]
    fixes: dict[str, Fix]
    families: list[GpuFamily]
    scoring: Scoring
    definitions: dict[str, Definition]
    folders: list[Path]
    taxonomy: Taxonomy
    host_links: list[HostLink] = field(default_factory=list)


def bundled_rules_dir() -> Path:
    """The rules shipped with traceclf: inside the wheel, else the checkout's rules/."""
    import traceclf

    for folder in (
        Path(traceclf.__file__).parent / "rules",
        Path(__file__).resolve().parents[2] / "rules",
    ):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    raise TraceError(None, "bundled rules not found (reinstall traceclf)")


def known_names() -> frozenset[str]:
    """Every measure (traceclf.measures.MEASURES) and context name a rule may use (from a
    rule stamp when one vouches for them: importing every measure costs a cached re-analysis
    more than the rest of it)."""
    global _NAMES
    if _NAMES is None:
        from traceclf.measures import MEASURES

        _NAMES = frozenset(MEASURES) | frozenset(CONTEXT_NAMES)
    return _NAMES


_NAMES: frozenset[str] | None = None


def load_rules(rules_dir: Path | str | None = None, remember: Path | None = None) -> RuleSet:
    """The bundled rule set, with ``rules_dir`` (if given) merged over it: an entry with the id
    of a bundled one replaces it. Raises TraceError naming the file for any problem.

    Read once per process while the files are unchanged (an analysis needs the rules for its
    checks, its taxonomy and its verdict): callers share the returned RuleSet, read-only. With
    ``remember`` (a cache root), a rule set that passed its checks is stamped there, and a
    stamped one is read without checking its patterns again (:mod:`traceclf.rulebook.stamp`)."""
    folders = [bundled_rules_dir()]
    if rules_dir is not None:
        user = Path(rules_dir)
        if not user.is_dir():
            raise TraceError(user, "rules folder not found")
        if not _yaml_files(user):
            raise TraceError(user, "no rule files (*.yaml) in this folder")
        folders.append(user)
    files = [_yaml_files(folder) for folder in folders]
    key = tuple((str(p), *_identity(p)) for layer in files for p in layer)
    if key not in _LOADED:
        if len(_LOADED) >= 8:  # a long-lived process with many --rules folders
            _LOADED.clear()
        _LOADED[key] = _load(folders, files, remember)
    return _LOADED[key]


_LOADED: dict[tuple, RuleSet] = {}


def _identity(path: Path) -> tuple[int, ...]:
    try:
        st = path.stat()
    except OSError:
        return ()  # reading it fails with the reason
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _load(folders: list[Path], layers: list[list[Path]], remember: Path | None) -> RuleSet:
    global _NAMES
    texts = [[(path, _read_text(path)) for path in layer] for layer in layers]  # (once each)
    docs = [[(path, _read_yaml(path, text)) for path, text in layer] for layer in texts]
    stamped = None
    if remember is not None:
        with contextlib.suppress(OSError):
            stamped = stamp.Stamp(remember, stamp.key([f for layer in texts for f in layer]))
    vouched = stamped.names if stamped is not None else None
    if vouched is not None and _NAMES is None:
        _NAMES = vouched
    with stamp.checked(vouched is None):
        ruleset = _parse(folders, docs, known_names())
    if stamped is not None:
        if vouched is None:
            stamped.write(known_names())
        stamp.ACTIVE = stamped
    return ruleset


def _parse(
    folders: list[Path], docs: list[list[tuple[Path, dict]]], known: frozenset[str]
) -> RuleSet:
    definitions = parse_definitions(docs, known)
    names = known | frozenset(definitions)
    rules: dict[str, Rule] = {}
    fixes: dict[str, Fix] = {}
    families: list[GpuFamily] = []
    host_links: list[HostLink] = []
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
        host_links = layer["host_links"] + host_links
        scoring_raw |= layer["scoring"]
    scoring = parse_scoring(scoring_raw, names)
    ruleset = RuleSet(
        rules, fixes, families, scoring, definitions, folders, parse_taxonomy(docs), host_links
    )
    _check_references(ruleset)
    return ruleset


def _yaml_files(folder: Path) -> list[Path]:
    found = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
    if len(found) > MAX_RULE_FILES:
        raise TraceError(folder, f"more than {MAX_RULE_FILES} rule files in this folder")
    return found


def _parse_layer(files: list[tuple[Path, dict]], names: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rules": {},
        "disabled": {},
        "fixes": {},
        "families": [],
        "host_links": [],
        "scoring": {},
    }
    for path, doc in files:
        for i, raw in enumerate(_entries(doc, "rules", path)):
            if _is_disable_stub(raw):  # `{id: x, enabled: false}` turns a bundled rule off
                out["disabled"][raw["id"]] = path
                continue
            _add_unique(out["rules"], parse_rule(raw, path, i, names), path, "rule")
        for i, raw in enumerate(_entries(doc, "fixes", path)):
            _add_unique(out["fixes"], parse_fix(raw, path, i, names), path, "fix")
        out["host_links"] += [
            parse_host_link(raw, path, i) for i, raw in enumerate(_entries(doc, "host_links", path))
        ]
        out["families"] += [
            parse_family(raw, path, i) for i, raw in enumerate(_entries(doc, "gpu_families", path))
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


def _read_yaml(path: Path, text: str | None = None) -> dict:
    text = _read_text(path) if text is None else text
    try:
        _check_shape(path, text)
        doc = yaml.load(text, Loader=_LOADER)  # a SafeLoader, C or Python
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        if "nesting depth" in str(e.problem):  # libyaml's own bound (1000), met before ours
            line = mark.line + 1 if mark else 0
            raise TraceError(
                path, f"line {line}: nested deeper than {MAX_YAML_DEPTH} levels"
            ) from None
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TraceError(path, f"not valid YAML{where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        problem = " ".join(str(e).split())[:200] or type(e).__name__
        if isinstance(e, ValueError) and "digits" in problem:
            limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
            problem = f"a number longer than {limit} digits"
        raise TraceError(path, f"cannot read rule file: {problem}") from None
    _check_keys(path, doc)
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


def _read_text(path: Path) -> str:
    """The file's text, read without blocking (a FIFO would hang a plain read) and only if it
    is a regular file of at most MAX_RULE_FILE_BYTES (``/dev/zero`` never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise TraceError(path, f"cannot read rule file: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(path, "not a regular file (a rule file must be a plain YAML file)")
        if st.st_size > MAX_RULE_FILE_BYTES:
            raise TraceError(
                path, f"rule file larger than {MAX_RULE_FILE_BYTES >> 20} MiB ({st.st_size} bytes)"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_RULE_FILE_BYTES + 1)
    except OSError as e:
        raise TraceError(path, f"cannot read rule file: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_RULE_FILE_BYTES:  # it grew while being read
        raise TraceError(path, f"rule file larger than {MAX_RULE_FILE_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(path, f"cannot read rule file: not UTF-8 text ({e.reason})") from None


def _check_shape(path: Path, text: str) -> None:
    """Bound nesting and alias expansion from the parser's events, before any object is
    built: PyYAML shares an alias's object, but whatever walks or prints the document
    afterwards (a message, ``str()``) pays for every expansion."""
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, expanded size when it opened)
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    expanded = 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                raise TraceError(path, f"line {line}: alias *{event.anchor} refers to itself")
            expanded += sizes[event.anchor]
        elif isinstance(event, yaml.ScalarEvent):
            expanded += 1 + len(event.value)
            if event.anchor:
                sizes[event.anchor] = 1 + len(event.value)
        elif isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append((event.anchor, expanded))
            expanded += 1
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise TraceError(path, f"line {line}: nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_nodes.pop()
            if anchor:
                sizes[anchor] = expanded - start
        if expanded > MAX_YAML_EXPANDED:
            raise TraceError(
                path,
                f"line {line}: aliases expand this file past {MAX_YAML_EXPANDED:,} characters "
                "(an alias bomb?); write the entries out",
            )


def _check_keys(path: Path, doc: Any) -> None:
    """Every mapping key is text: the entries compare and sort them, and YAML turns an
    unquoted ``1:``, ``yes:`` or ``~:`` into a number, a boolean or null."""
    pending = [doc]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise TraceError(path, f"mapping key {key!r} is not text (quote it)")
                pending.append(value)
        elif isinstance(node, list):
            pending.extend(node)


def _entries(doc: dict, key: str, path: Path) -> list:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise TraceError(path, f"{key}: must be a list of entries")
    return value


def _add_unique(into: dict, item: Rule | Fix, path: Path, kind: str) -> None:
    if item.id in into:
        raise TraceError(path, f"{kind} {item.id!r}: defined twice in {path.parent.name}/")
    into[item.id] = item


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
