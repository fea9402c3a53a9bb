"""``flowrl diff``'s tables: where two runs part, and how the difference spread.

Example::

    from flowrl.provenance.rundiff import diff_runs
    console.print(render_diff(diff_runs(a, b), "runs/a", "runs/b"))
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


def render_diff(report: dict[str, Any], name_a: str, name_b: str) -> Group:
    """The verdict, the graphs' differences, the finding and its spread."""
    parts: list[Any] = []
    compared = f"{report['steps_compared']} step(s) compared"
    if report["same"]:
        parts.append(Text(f"identical: {name_a} and {name_b} agree on every node output and weight digest "
                          f"({compared})", style="green"))
    else:
        parts.append(Text(f"the runs differ ({compared}; {report['differences']} differing outputs)",
                          style="bold red"))
    if report["steps_a"] != report["steps_b"]:
        parts.append(Text(f"run A recorded {report['steps_a']} step(s), run B {report['steps_b']}", style="yellow"))
    if report["graph_differences"]:
        parts.append(Text("the graphs differ: " + "; ".join(report["graph_differences"]), style="yellow"))
    if report["parameter_differences"]:
        parts.append(Text("parameters differ: " + "; ".join(report["parameter_differences"]), style="yellow"))
    f = report["finding"]
    if f is not None:
        table = Table(title="first difference" + (" introduced (its inputs were equal)" if f["inputs_equal"]
                                                 else " (no node with equal inputs: all were inherited)"),
                      title_justify="left")
        table.add_column("", style="bold")
        table.add_column("run A", overflow="fold")
        table.add_column("run B", overflow="fold")
        table.add_row("step", str(f["step"]), "")
        table.add_row("node", f["node"], "")
        table.add_row("field", f["field"], "")
        table.add_row("inputs", "equal" if f["inputs_equal"] else "differ: " + ", ".join(f["inputs_differing"]), "")
        if "rows" in f:
            table.add_row("rows differing", f"{f['rows_differing']} of {f['rows_total']}",
                          "first: " + ", ".join(map(str, f["rows"])))
        table.add_row("shape", _num(f.get("shape_a")), _num(f.get("shape_b")))
        for k in ("mean", "min", "max", "nan", "inf"):
            if f"{k}_a" in f:
                table.add_row(k, _num(f[f"{k}_a"]), _num(f[f"{k}_b"]))
        if "size" in f:
            table.add_row("|mean A - mean B|", _num(f["size"]), "")
        parts.append(table)
        if f.get("metrics"):
            metrics = Table(title=f"step {f['step']}'s metrics that differ", title_justify="left")
            for col in ("metric", "run A", "run B", "relative"):
                metrics.add_column(col, overflow="fold")
            for m in f["metrics"]:
                metrics.add_row(m["metric"], _num(m["a"]), _num(m["b"]), f"{m['relative']:.2e}")
            parts.append(metrics)
    if report["spread"]:
        spread = Table(title="how it spread (later differences, inherited)", title_justify="left")
        for col in ("node", "first step", "steps differing", "fields"):
            spread.add_column(col, overflow="fold")
        for s in report["spread"]:
            spread.add_row(s["node"], str(s["first_step"]), str(s["steps"]), ", ".join(s["fields"]))
        parts.append(spread)
    return Group(*parts)


__all__ = ["render_diff"]
