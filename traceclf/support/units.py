"""How a number reads, the same everywhere (every renderer, figures, comparisons, the CLI):
fractions as percentages, durations, sizes, relative changes and gain ceilings."""

from __future__ import annotations

import math


def pct(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{100 * v:.1f}%" if abs(v) < 0.1 else f"{100 * v:.0f}%"


def fmt_ms(v: float | None) -> str:
    """A duration given in ms: '0.0524 ms', '2.5 s', and under a µs in ns ('40.6 ns', not
    '4.06e-05 ms')."""
    if v is None:
        return "–"
    if 0 < abs(v) < 0.001 and abs(float(f"{v * 1e6:.3g}")) < 1000:  # (999.6 ns: "0.001 ms")
        return f"{v * 1e6:.3g} ns"
    return f"{sig(v)} ms" if abs(float(f"{v:.3g}")) < 1000 else f"{sig(v / 1000)} s"


def sig(v: float) -> str:
    """Three significant digits, never in scientific notation ('1,000', not '1e+03';
    '0.0000123', not '1.23e-05')."""
    text = f"{v:.3g}"
    if "e" not in text:
        return text
    if abs(v) >= 1:
        return f"{v:,.0f}"
    return f"{v:.{2 - math.floor(math.log10(abs(v)))}f}"


def fmt_us(v: float | None) -> str:
    """A duration given in µs: '4.38 µs', '27.1 ms' (not '27,134 µs' or '6.56e+03 µs')."""
    if v is None:
        return "–"
    return f"{v:.3g} µs" if abs(v) < 1000 else fmt_ms(v / 1000)


def signed_pct(v: float | None) -> str:
    """A relative change: '+3.2%', '-45%'."""
    if v is None:
        return "–"
    return f"{v:+.0%}" if abs(v) >= 1 else f"{v:+.1%}"


def fmt_bytes(v: float | None) -> str:
    """Bytes in the unit their size needs, three significant digits: '2.82 GB', '1 MB' (not
    '1e+03 KB' for 999,950 B), never in scientific notation."""
    if v is None or not math.isfinite(v):
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(float(f"{v:.3g}")) < 1000:  # (as printed: 999.95 KB is 1 MB)
            return f"{v:.0f} B" if unit == "B" else f"{sig(v)} {unit}"
        v /= 1000
    return f"{sig(v)} TB"


def gain(value: float | None) -> str:
    """A throughput gain ceiling: '+12%', or '×40' once it passes doubling ('-5.0%': a loss)."""
    if value is None:
        return "–"
    return f"×{1 + value:.3g}" if value >= 1 else f"{'+' * (value >= 0)}{pct(value)}"


def counted(n: int, noun: str) -> str:
    """'1 call', '3 calls', '2 long gaps': a count with its noun in the number it takes."""
    return f"{n:,} {noun if n == 1 else plural(noun)}"


def plural(noun: str) -> str:
    """The plural of a noun phrase: its first word that takes one ('cudaMalloc/cudaFree call
    per step' -> '... calls per step'), or else its last ('long gap' -> 'long gaps')."""
    words = noun.split(" ")
    at = next((i for i, w in enumerate(words) if w in _PLURAL_FIRST), len(words) - 1)
    word = words[at]
    if word.endswith("y") and word[-2:-1] not in ("a", "e", "i", "o", "u", ""):
        words[at] = word[:-1] + "ies"
    else:
        words[at] = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return " ".join(words)


_PLURAL_FIRST = {"call", "copy", "launch", "kernel"}  # (pluralised where a phrase goes on)
