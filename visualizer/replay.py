"""``flowrl replay``'s table: each metric the replayed nodes computed, as the run logged it and as replayed.

Example::

    from flowrl.run.replay import replay_step
    console.print(render_replay(replay_step("runs/grpo", 3, "advantage", {...})))
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _num(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def render_replay(report: dict[str, Any]) -> Group:
    """What was replayed from where, then the metrics table (differences in colour)."""
    sets = ", ".join(f"{k}={v}" for k, v in report["overrides"].items()) or "no overrides"
    rolled = report["rolled_forward"]
    head = Text(f"step {report['step']} of {report['run']} replayed from {report['from']!r} "
                f"({', '.join(report['nodes'])}) with {sets}; weights from {report['checkpoint']}"
                + (f", rolled forward through step(s) {', '.join(map(str, rolled))}" if rolled else ""))
    table = Table(title="metrics: as the run logged them and as replayed", title_justify="left")
    for col in ("metric", "run", "replay", "difference"):
        table.add_column(col, overflow="fold", justify="left" if col == "metric" else "right")
    for row in report["metrics"]:
        style = None if row["diff"] == 0 else "yellow"
        table.add_row(row["metric"], _num(row["run"]), _num(row["replay"]),
                      "=" if row["diff"] == 0 else f"{row['diff']:+.6g}", style=style)
    verdict = (Text("every metric as the run logged it", style="green") if report["same"] else
               Text(f"{sum(r['diff'] != 0 for r in report['metrics'])} of {len(report['metrics'])} metrics differ",
                    style="bold yellow"))
    return Group(head, table, verdict)


__all__ = ["render_replay"]
