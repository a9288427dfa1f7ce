"""Figures of a report: :mod:`.series` computes, per rank while its trace is loaded, the small
series they are drawn from (kept in ``report.series``); :mod:`.draw` draws them with
matplotlib (imported only there, so the analysis never loads it)."""
