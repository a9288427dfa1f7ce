"""What is wrong with a regular expression, in the words of polars' engine (Rust ``regex``)."""

from __future__ import annotations


def regex_problem(error: Exception) -> str:
    """The engine's own one-line reason ("unclosed character class", "look-around ... is not
    supported", "Compiled regex exceeds size limit of 10485760 bytes"), without the polars
    expression the error was raised from."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next(
        (line[len("error:") :].strip() for line in lines if line.startswith("error:")), ""
    )
    if not reason and lines:
        first = lines[0].removeprefix("regex error:").strip()
        if not first.startswith("regex parse error"):
            reason = first
    if "exceeds size limit" in reason:  # the engine's bound on memory, not its syntax
        reason = (
            "too large: compiled, it exceeds the regex engine's size limit (repetitions of "
            "repetitions multiply, e.g. a{1000}{1000})"
        )
    return reason or "not supported by the regex engine"
