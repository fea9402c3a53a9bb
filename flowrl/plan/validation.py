"""Validation: the part of a step that scores responses, run greedily on held-out prompts.

The validation graph is derived from the training graph: the first node whose
operator declares a ``score`` output (a reward) and everything it depends on,
with one sample per prompt (an expanding node's factor set to 1) and the
parameters each operator declares for validation (``val_params``: greedy
decoding for ``rollout.generate``). The core names no field: the operators say
what scores and how to validate. It runs in the same workers as training,
queued right behind a step's tasks, so it sees exactly that step's weights.

Example::

    val = validation_graph(graph)            # None when the graph scores nothing
    print(list(val.nodes))                   # ['generate', 'reward']
"""

from __future__ import annotations

import networkx as nx

from flowrl.graph import SOURCE, Graph
from flowrl.graph.config import GraphConfig


def validation_graph(graph: Graph) -> Graph | None:
    """The scoring sub-graph of ``graph`` for validation, or None if nothing scores."""
    found = graph.scorer()
    if found is None:
        return None
    scorer = found[0]
    keep = (nx.ancestors(graph.dag, scorer) | {scorer}) - {SOURCE}
    nodes = {}
    for name in graph.nodes:
        if name not in keep:
            continue
        node = graph.nodes[name]
        cfg = node.config.dump()
        if node.op is not None and node.op.expands:
            cfg[node.op.expands] = 1
        if node.op is not None:
            cfg.update(node.op.val_params)
        nodes[name] = cfg
    dump = graph.config.dump()
    dump.update(name=f"{graph.name}.val", nodes=nodes, schedule={**dump["schedule"], "micro_batches": 1})
    return Graph.from_config(GraphConfig.model_validate(dump), source_file=graph.source_file)
