"""The recovery wing: what happens when a step fails — failure policies, refills, dead workers
replaced, rollbacks, and tasks stuck past their time — decided by one
:class:`~flowrl.recovery.recovery.Recovery`, which answers the runtime with outcomes.

Imports ``data``, ``graph``, ``plan``, ``store`` and ``runtime``.
"""
