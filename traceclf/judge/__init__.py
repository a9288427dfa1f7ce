"""Judgement: the rule files (rules/*.yaml) loaded and validated (:mod:`.schema`,
:mod:`.entries`, :mod:`.taxonomy`), their expression language (:mod:`.expr`), and the engine
that fires them on a run's measures (:mod:`.engine`). Named ``judge`` so that it never collides
with the bundled ``rules/`` data, which the wheel installs as ``traceclf/rules``."""
