"""flowrl: reinforcement learning for language models as a declarative dataflow graph.

Example::

    from flowrl import graph
    from operators import rollout, reward

    @graph(name="tiny", ...)
    def step(batch):
        batch = rollout.generate(batch, n=4)
        return reward.rule(batch)
"""

from flowrl import graph  # noqa: F401  (the package is callable: @graph(...))

__version__ = "0.1.0"
__all__ = ["graph", "__version__"]
