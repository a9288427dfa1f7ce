"""Judgement: what rules may name and the rule set checked against it (:mod:`.vocabulary`),
the engine that fires the rules on a run's measures (:mod:`.engine`), the gain ceiling of each
fix (:mod:`.ceiling`), and whether the capture supports a verdict at all (:mod:`.abstention`).
The rule files themselves are data, read by :mod:`traceclf.rulebook`."""
