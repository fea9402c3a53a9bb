"""The store wing: what a run keeps on disk — checkpoints and their state files, metrics sinks,
the run directory's lock, its log, and rollout dumps. The only code that knows those layouts.

Imports ``data`` and ``graph``.
"""
