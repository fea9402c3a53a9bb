"""flowrl: reinforcement learning for language models as a declarative dataflow graph.

Example::

    from flowrl import graph
    from operators import rollout, reward

    @graph(name="tiny", ...)
    def step(batch):
        batch = rollout.generate(batch, n=4)
        return reward.rule(batch)
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["graph", "__version__"]


def __getattr__(name: str) -> Any:
    # flowrl.graph (callable: @graph(...)) is imported on first use, so `flowrl --help` and
    # `import flowrl.cli` do not pay for networkx and pydantic models they never touch
    if name == "graph":
        return importlib.import_module("flowrl.graph")
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")
