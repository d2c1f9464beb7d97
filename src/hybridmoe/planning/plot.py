"""`hybridmoe plan --plot`: predicted tok/s and hit rate against cache size (matplotlib, the
optional extra `plot`)."""

from __future__ import annotations

from pathlib import Path

from hybridmoe.errors import HybridMoeError
from hybridmoe.planning.cost_model import CostModel
from hybridmoe.planning.planner import PlanRow


class MissingExtraError(HybridMoeError, ImportError):
    """An optional extra's package is not installed."""


def require_pyplot():
    """matplotlib.pyplot on the file-only backend; MissingExtraError naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtraError(
            "--plot needs matplotlib: pip install 'hybridmoe[plot]' (the optional extra `plot`)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_plan(rows: list[PlanRow], model: CostModel, path: str | Path, source: str) -> None:
    """Two panels side by side: tok/s per target, and hybrid's hit rate, over residency."""
    plt = require_pyplot()
    total = model.shape.total_experts
    fig, (speed, hits) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for target, style in (("offload", "s-"), ("hybrid", "o-")):
        mine = [r for r in rows if r.target == target]
        x = [100 * r.residency(total) for r in mine]
        speed.plot(x, [r.cost.tok_per_s for r in mine], style, label=target, markersize=4)
        if target == "hybrid":
            hits.plot(x, [100 * r.outcome.hit_rate for r in mine], style, label="LRU hit rate")
            hits.plot(x, [100 * r.outcome.cpu_share for r in mine], "^--", label="CPU routes")
    for row in rows:
        if row.target in ("cpu", "resident"):
            speed.axhline(
                row.cost.tok_per_s,
                linestyle=":",
                color="grey" if row.target == "cpu" else "green",
                label=f"{row.target} ({row.cost.tok_per_s:.1f})",
            )
    speed.set(xlabel="experts resident (%)", ylabel="predicted decode tok/s", ylim=(0, None))
    hits.set(xlabel="experts resident (%)", ylabel="% of routes", ylim=(0, 100))
    speed.legend(fontsize=7)
    hits.legend(fontsize=7)
    fig.suptitle(
        f"hybridmoe plan: {model.shape.name}, {model.expert_format} experts; {source}", fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
