"""The plan wing: a checked graph made concrete (pools, row spaces, task order, staleness),
its simulation and cost model, the configuration search, and the run's check of its prediction.

Imports ``data`` and ``graph``; never the runtime, which runs what this decides.
"""
