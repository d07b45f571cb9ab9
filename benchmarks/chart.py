"""The chart each side-by-side benchmark writes: one bar per system, measured in the same run.

    from benchmarks.chart import save_bars
    save_bars("engine_vs_hf", "output tokens/s", [("genq engine", 3072.0), ("transformers", 485.0)])

Writes benchmarks/results/<name>.png (the figures' JSON sits beside it). docs/benchmarks.md shows
the current chart of each benchmark, copied from a run into docs/img/. matplotlib is optional (the
`bench` extra): without it the benchmark prints one line and still writes its table and JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# genq's bars first and in one colour, every peer in another, so a chart reads at a glance.
GENQ_COLOUR = "#2b6cb0"
PEER_COLOUR = "#a0aec0"


def save_bars(name: str, unit: str, bars: Sequence[tuple[str, float]], *,
              title: str | None = None, out_dir: Path = RESULTS) -> Path | None:
    """One horizontal bar per (label, value); labels starting with "genq" are genq's own."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on a server; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no chart for {name}: pip install matplotlib, or 'genq[bench]')")
        return None
    labels = [label for label, _ in bars]
    values = [float(value) for _, value in bars]
    colours = [GENQ_COLOUR if label.startswith("genq") else PEER_COLOUR for label in labels]
    fig, ax = plt.subplots(figsize=(7.0, 0.5 + 0.45 * len(bars)))
    ax.barh(range(len(bars)), values, color=colours)
    ax.set_yticks(range(len(bars)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or name.replace("_", " "))
    top = max(values, default=0.0)
    for i, value in enumerate(values):
        ax.text(value + top * 0.01, i, f"{value:,.3g}" if value < 100 else f"{value:,.0f}",
                va="center", fontsize=9)
    ax.set_xlim(0, top * 1.18 if top > 0 else 1)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")
    return path
