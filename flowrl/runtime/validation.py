"""Validation: the part of a step that scores responses, run greedily on held-out prompts.

The validation graph is derived from the training graph: the node producing the
score field (``token_level_scores`` by default) and everything it depends on,
with one sample per prompt (an expanding node's factor set to 1) and greedy
decoding where an operator offers it. It runs in the same workers as training,
queued right behind a step's tasks, so it sees exactly that step's weights.

Example::

    val = validation_graph(graph)            # None when the graph scores nothing
    print(list(val.nodes))                   # ['generate', 'reward']
"""

from __future__ import annotations

import networkx as nx

from flowrl.graph import SOURCE, Graph
from flowrl.graph.config import GraphConfig

SCORE_FIELD = "token_level_scores"


def validation_graph(graph: Graph, score_field: str = SCORE_FIELD) -> Graph | None:
    """The scoring sub-graph of ``graph`` for greedy validation, or None if nothing scores."""
    producers = graph.producers().get(score_field, [])
    if len(producers) != 1 or producers[0] == SOURCE:
        return None
    scorer = producers[0]
    keep = (nx.ancestors(graph.dag, scorer) | {scorer}) - {SOURCE}
    nodes = {}
    for name in graph.nodes:
        if name not in keep:
            continue
        node = graph.nodes[name]
        cfg = node.config.dump()
        if node.op is not None and node.op.expands:
            cfg[node.op.expands] = 1
        if node.op is not None and "greedy" in node.op.params.model_fields:
            cfg["greedy"] = True
        nodes[name] = cfg
    dump = graph.config.dump()
    dump.update(name=f"{graph.name}.val", nodes=nodes, schedule={**dump["schedule"], "micro_batches": 1})
    return Graph.from_config(GraphConfig.model_validate(dump), source_file=graph.source_file)
