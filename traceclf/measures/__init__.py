"""The numbers behind the four walls, for one rank over its steady-state window.

One module per wall computes that wall's measures and owns their one-line definitions
(``MEASURES``): :mod:`.budget` (step time, busy, idle, compute, communication and copies),
:mod:`.critical_path` (what blocked compute), :mod:`.communication`, :mod:`.memory`,
:mod:`.host` (with :mod:`.hostsources`: where idle time went, by host source) and
:mod:`.compute`; :mod:`.cross_rank` holds the numbers across ranks; :mod:`.window`
prepares the clipped, classified frames and the unions of GPU work they all read, and
:mod:`.intervals` holds the interval arithmetic. What a rank hands to the cross-rank stage is
:mod:`.handoff`. Measures return numbers; the judge (traceclf/judge) decides. ``traceclf
measures`` prints the definitions; docs/measures.md lists them with the function that computes
each.

Every ``*_frac`` is a fraction of the window's wall time unless its definition says otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceclf.measures.rank import MEASURES, RankMeasures, measure_rank

__all__ = ["MEASURES", "RankMeasures", "measure_rank"]


def __getattr__(name: str) -> Any:
    """``MEASURES``, ``measure_rank`` and ``RankMeasures`` from :mod:`.rank`, imported on
    first use (PEP 562)."""
    if name in __all__:
        from traceclf.measures import rank

        return getattr(rank, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
