"""Terminal rendering of flowrl graphs: the DAG drawing and its exports.

Example::

    from flowrl.graph import load_graph
    from visualizer import print_dag, to_mermaid

    graph = load_graph("graphs/ppo.yaml")
    print_dag(graph)
    print(to_mermaid(graph))
"""

from visualizer.dag import STATES, pool_colors, print_dag, render_dag, state_style
from visualizer.export import to_dot, to_json, to_mermaid

__all__ = ["STATES", "pool_colors", "print_dag", "render_dag", "state_style", "to_dot", "to_json", "to_mermaid"]
