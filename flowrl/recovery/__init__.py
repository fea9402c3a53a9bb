"""The recovery wing: what happens when a step fails — failure policies, refills, dead workers
replaced, rollbacks, and tasks stuck past their time.

Imports ``data``, ``graph``, ``plan``, ``store`` and ``runtime``.
"""
