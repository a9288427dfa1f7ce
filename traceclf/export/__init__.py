"""Files beyond the report itself: the report's tables (:mod:`traceclf.report.frames`) written
as CSV or Parquet and figures beside a Markdown report (:mod:`.files`), and the steady-state
window as a Chrome/Perfetto trace (:mod:`.perfetto`)."""
