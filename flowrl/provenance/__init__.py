"""The provenance wing: what every node produced — fingerprints and their digests, records of
exact outputs, the invariants checked on them, and ``flowrl diff``'s comparison.

Imports ``data``, ``graph``, ``plan``, ``store`` and ``runtime``.
"""
