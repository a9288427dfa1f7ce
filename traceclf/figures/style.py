"""What every figure shares: the walls' colours (memory magenta, communication teal, host
orange, compute green, idle grey), the width, and the title and grid of a panel."""

from __future__ import annotations

import io

from matplotlib.axes import Axes
from matplotlib.figure import Figure

# Figure() with no pyplot never touches an interactive backend; Agg draws it.
WALL_COLORS = {
    "memory": "#c2187d",
    "communication": "#0f9aa8",
    "host": "#ef8a17",
    "compute": "#3a9e4d",
    "idle": "#a3a3a3",
}
MAX_RANK_PANELS = 8  # beyond this a per-rank panel stack stops being readable
WIDTH_IN = 9.0
FIGURE_DPI = 110


class ReportFigure(Figure):
    """A figure that shows itself in Jupyter as a PNG. IPython asks an object for
    ``_repr_png_`` when no display formatter is registered for its type, and a Figure made
    without pyplot has none unless ``%matplotlib inline`` registered one (when it did, that
    formatter is used instead): without this, ``display(fig)`` prints ``<Figure size ...>``."""

    def _repr_png_(self) -> bytes:
        return figure_png(self)


def figure_png(fig: Figure) -> bytes:
    """``fig`` as a PNG file's bytes (the HTML report embeds them, Markdown links them)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    return buffer.getvalue()


def figure_title(fig: Figure, text: str, subtitle: str | None = None) -> None:
    fig.suptitle(text, fontsize=13, fontweight="bold")
    if subtitle:  # a quieter note over the top panel, which constrained layout makes room for
        fig.axes[0].set_title(subtitle, loc="left", fontsize=9, color="#555555")


def light_grid(ax: Axes, axis: str) -> None:
    ax.grid(axis=axis, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
