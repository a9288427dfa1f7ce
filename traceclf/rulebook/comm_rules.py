"""The ``communicators:`` section of rule files (rules/communication.yaml): what a communicator's
collectives say about the parallel dimension it serves, and NCCL's bandwidth formulas, as data
(docs/rules.md, "Communicators"). A later folder's keys replace the bundled ones whole.

- ``kinds``: collective kind -> the dimensions a communicator running it may serve;
- ``in_forward`` / ``not_in_forward``: the same, for kinds launched inside an NVTX forward range,
  and for kinds none of whose launches is (in a capture that has forward ranges);
- ``with_moe``: the same, when the capture shows mixture-of-experts routing;
- ``bus_factor``: per kind, nccl-tests' bus-bandwidth factor ``times`` x ((n-1)/n when
  ``per_peer``);
- ``message_times_ranks``: the NCCL calls whose NVTX message size is one rank's share, so that
  the operation's size (nccl-tests' S) is that times the communicator's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceclf.rulebook.yamlfile import section
from traceclf.support.errors import TraceError

DIMENSIONS = ("ep", "dp", "tp", "pp", "cp")
RESTRICTIONS = ("kinds", "in_forward", "not_in_forward", "with_moe")
KEYS = (*RESTRICTIONS, "bus_factor", "message_times_ranks")


@dataclass(frozen=True)
class BusFactor:
    times: float
    per_peer: bool

    def of(self, ranks: int) -> float:
        """The factor for a communicator of ``ranks`` ranks."""
        return self.times * ((ranks - 1) / ranks if self.per_peer and ranks > 0 else 1.0)


@dataclass(frozen=True)
class CommRules:
    kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    in_forward: dict[str, tuple[str, ...]] = field(default_factory=dict)
    not_in_forward: dict[str, tuple[str, ...]] = field(default_factory=dict)
    with_moe: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bus_factor: dict[str, BusFactor] = field(default_factory=dict)
    message_times_ranks: tuple[str, ...] = ()


def parse_communicators(layers: list[list[tuple[Path, dict]]]) -> CommRules:
    """Every layer's ``communicators:`` section, a later layer's keys over earlier ones."""
    merged: dict[str, Any] = {}
    for files in layers:
        for path, doc in files:
            raw = section(doc, "communicators", path, keys=tuple(KEYS), expected=True)
            for key, value in (raw or {}).items():
                merged[key] = _parse(key, value, path)
    return CommRules(**merged)


def _parse(key: str, value: Any, path: Path) -> Any:
    where = f"communicators: {key}"
    if key == "message_times_ranks":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TraceError(path, f"{where}: must be a list of NCCL call names")
        return tuple(value)
    if not isinstance(value, dict):
        raise TraceError(path, f"{where}: must be a mapping of collective kind to entries")
    out: dict[str, Any] = {}
    for kind, entry in value.items():
        if not isinstance(kind, str) or not kind.isidentifier():
            raise TraceError(path, f"{where}: {kind!r} is not a collective kind")
        out[kind] = (
            _bus(entry, f"{where}.{kind}", path)
            if key == "bus_factor"
            else _dims(entry, f"{where}.{kind}", path)
        )
    return out


def _dims(entry: Any, where: str, path: Path) -> tuple[str, ...]:
    if not isinstance(entry, list) or not entry or not set(entry) <= set(DIMENSIONS):
        raise TraceError(path, f"{where}: must be a list of dimensions ({', '.join(DIMENSIONS)})")
    return tuple(entry)


def _bus(entry: Any, where: str, path: Path) -> BusFactor:
    times = entry.get("times") if isinstance(entry, dict) else None
    per_peer = entry.get("per_peer") if isinstance(entry, dict) else None
    if (
        not isinstance(entry, dict)
        or set(entry) != {"times", "per_peer"}
        or isinstance(times, bool)
        or not isinstance(times, (int, float))
        or not 0 < times <= 16
        or not isinstance(per_peer, bool)
    ):
        raise TraceError(path, f"{where}: must be {{times: a number in (0, 16], per_peer: bool}}")
    return BusFactor(float(times), per_peer)
