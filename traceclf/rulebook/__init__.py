"""Rule files as data: the expression language, typed entries, reading and merging rule folders
(bundled rules/, then --rules) and the stamp of a rule set that passed its checks. Nothing here
builds a polars expression or knows a measure: the taxonomy module turns the taxonomy tables into
expressions, and the judge names what rules may use."""
