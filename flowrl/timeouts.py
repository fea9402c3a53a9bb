"""Every default time limit, in one table: how long flowrl waits on something before it names it.

A graph file overrides the first two (``pools.<name>.timeout_s``, ``schedule.timeout_s``) and a
rollout its tool calls' (``tool_timeout_s``); the rest bound how long the driver or a worker waits
for a process, a peer or a cluster to answer before the failure is reported with what did not
answer. Every default of these limits reads this table, so the numbers the docs and the messages
quote are the ones that apply.

Example::

    from flowrl.timeouts import COLLECTIVE_S
    group = PoolGroup.form(address, rank, world, "train", timeout_s=COLLECTIVE_S)
"""

from __future__ import annotations

#: one collective of a pool's process group (``pools.<name>.timeout_s``)
COLLECTIVE_S = 300.0
#: every rank of a pool joining its process group when the workers start
GROUP_JOIN_S = 600.0
#: a node's task that sets no ``timeout_s`` of its own (``schedule.timeout_s``; an hour)
TASK_S = 3600.0
#: a worker asked for its threads' stacks (a hang's report)
STACKS_S = 5.0
#: Ray granting the placement groups of the run's pools
PLACEMENT_S = 60.0
#: a Ray cluster's ``host:port`` answering a connection before ``ray.init`` joins it (Ray would retry for minutes)
RAY_REACH_S = 5.0
#: a broken collective's diagnosis: the rendezvous store answering, and a peer whose connection broke dying
DIAGNOSE_S = 2.0
#: an idle local-backend worker thread leaving at shutdown (a hung one is left behind)
THREAD_EXIT_S = 2.0
#: one tool call or environment step of a multi-turn rollout (``tool_timeout_s``)
TOOL_CALL_S = 10.0
#: a task this many times past its predicted seconds is reported stuck, with its stacks (``trainer.stuck_factor``)
STUCK_FACTOR = 10.0
#: ... and at least this long past its start (``trainer.stuck_min_s``): short tasks vary more than 10×
STUCK_MIN_S = 60.0

__all__ = ["COLLECTIVE_S", "DIAGNOSE_S", "GROUP_JOIN_S", "PLACEMENT_S", "RAY_REACH_S", "STACKS_S", "STUCK_FACTOR", "STUCK_MIN_S", "TASK_S",
           "THREAD_EXIT_S", "TOOL_CALL_S"]
