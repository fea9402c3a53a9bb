"""``on_error: {then: refill}``: the groups a node still fails on are replaced by fresh prompts.

The worker finds the groups its operator fails on (as for ``drop_group``) and
reports them (:class:`~flowrl.recovery.faults.RefillNeeded`). The driver then:

1. draws as many fresh prompts from the data source, keyed by the run's seed,
   the step and the round (:func:`keyed_draw`): a resumed run draws the very
   same ones, whatever it read before;
2. puts them in the failed prompts' places in the step's batch (their group key,
   the column the graph's operators declare as ``group_key`` — verl's ``uid`` —
   renamed ``<step>-refill<round>-<i>``, prompt columns left-padded to one width);
3. runs the step again on it: every task of the step, and every task of a
   later step in flight that waited on one of them, submitted again through the
   path a dead worker's lost tasks take
   (:meth:`~flowrl.runtime.steps.RecoveryPort.resubmit_lost`); keyed sampling
   seeds make the prompts that did not fail produce what they produced before.

``faults/refilled_groups`` counts them. A step whose update or stateful
operator already ran cannot run again: it fails, named; so does a step still
failing after :data:`MAX_ROUNDS` rounds. :func:`refill` answers with the
outcome (:class:`~flowrl.runtime.steps.Resubmitted`, or a
:class:`~flowrl.runtime.steps.Fail`).

Example::

    draw = keyed_draw(graph.config)
    fresh = draw(step=4, k=2, round=1)
"""

from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import torch

from flowrl.data import DataProto
from flowrl.errors import RuntimeFailure
from flowrl.graph import Graph
from flowrl.graph.config import GraphConfig
from flowrl.graph.registry import make_source
from flowrl.plan.planner import Plan, row_keys
from flowrl.recovery.faults import RefillNeeded
from flowrl.runtime.steps import Fail, RecoveryPort, Resubmitted, StepRun

#: rounds of fresh prompts one step may draw before it fails
MAX_ROUNDS = 3

Draw = Callable[[int, int, int], DataProto]


class RefillError(RuntimeFailure):
    """A step could not be refilled."""


def refill_of(exc: BaseException) -> RefillNeeded | None:
    """The :class:`RefillNeeded` a failed report carries (itself, or a Ray error's cause)."""
    cause = getattr(exc, "cause", None)
    return exc if isinstance(exc, RefillNeeded) else cause if isinstance(cause, RefillNeeded) else None


def refill_seed(seed: int, step: int, round_: int) -> int:
    digest = hashlib.sha256(f"flowrl-refill:{seed}:{step}:{round_}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def keyed_draw(cfg: GraphConfig) -> Draw:
    """``draw(step, k, round)``: ``k`` fresh prompts of the graph's data source, from a source
    seeded by (run seed, step, round) — the same prompts whenever they are drawn."""
    def draw(step: int, k: int, round_: int) -> DataProto:
        source = make_source(cfg, seed=refill_seed(cfg.trainer.seed, step, round_))
        batch = next(source)
        if len(batch) < k:
            raise RefillError(f"the data source gave {len(batch)} prompts; {k} are needed to refill step {step + 1}")
        return batch[list(range(k))]

    return draw


def group_column(graph: Graph, node: str) -> str | None:
    """The column whose equal values mark one group (verl's ``uid``): the one ``node``'s operator
    declares as ``group_key``, else the one a group-scoped node of the graph declares (by its name
    in the graph); None when no operator declares one."""
    keys = (row_keys(n).groups for n in (graph.nodes[node], *graph.nodes.values()))
    return next((k for k in keys if k is not None), None)


def failed_rows(need: RefillNeeded, plan: Plan, batch: DataProto, key: str | None) -> list[int]:
    """The source rows (prompts) of the failed groups: by their group key ``key`` when the node read
    it, else by place (a task on one rank: its groups are its micro-batch's prompts, in order)."""
    if need.uids is not None and key is not None and key in batch.non_tensor_batch:
        wanted = set(need.uids)
        return [i for i, u in enumerate(batch.non_tensor_batch[key]) if u in wanted]
    task = plan.tasks[(need.node, need.mb)]
    if len(task.ranks) > 1:
        raise RefillError(f"node {need.node!r}: on_error refill on {len(task.ranks)} ranks needs the groups' key "
                          f"({key or 'no operator declares a group_key'}); the node does not read it")
    start = plan.prompt_bounds[need.mb] if need.mb is not None else 0
    return [start + g for g in need.groups]


def splice(batch: DataProto, rows: list[int], fresh: DataProto, step: int, round_: int,
           key: str | None = None) -> DataProto:
    """``batch`` with its rows ``rows`` replaced by ``fresh``'s rows, in order; their group key
    column ``key`` renamed so that no fresh group takes an old one's name."""
    fresh = fresh[list(range(len(rows)))]
    if key is not None and key in fresh.non_tensor_batch:
        fresh.non_tensor_batch[key] = np.array([f"{step}-refill{round_}-{i}" for i in range(len(rows))],
                                               dtype=object)
    batch, fresh = _left_pad_alike(batch, fresh)
    both = DataProto.concat([batch, fresh])
    at = {r: len(batch) + j for j, r in enumerate(rows)}
    return both[[at.get(i, i) for i in range(len(batch))]]


def _left_pad_alike(a: DataProto, b: DataProto) -> tuple[DataProto, DataProto]:
    """Prompt columns (left-padded) of two batches padded on the left to one width."""
    if a.batch is None or b.batch is None:
        return a, b
    for key in a.batch.keys():
        x, y = a.batch[key], b.batch[key]
        if x.dim() == 2 and y.dim() == 2 and x.shape[1] != y.shape[1]:
            width = max(x.shape[1], y.shape[1])
            a.batch[key] = _pad_left(x, width)  # noqa: the batch is the driver's own copy
            b.batch[key] = _pad_left(y, width)
    return a, b


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[1] == width else torch.cat([t.new_zeros(t.shape[0], width - t.shape[1]), t], dim=1)


def refill(need: RefillNeeded, st: StepRun, port: RecoveryPort) -> Resubmitted | Fail:
    """Run step ``st`` (the step being finished) again with the failed groups' prompts replaced (see the
    module docstring), or fail it, named, when it cannot."""
    st.faults["refill_rounds"] += 1
    rounds = int(st.faults["refill_rounds"])
    what = f"node {need.node!r} at step {st.step + 1}"
    if st.plan.kind != "train":
        return Fail(RefillError(f"{what} (validation) failed on {len(need.groups)} group(s): {need.cause}"))
    if rounds > MAX_ROUNDS:
        return Fail(RefillError(f"{what} still fails on {len(need.groups)} group(s) after {MAX_ROUNDS} rounds of "
                                f"fresh prompts: {need.cause}"))
    done = [k for h, (k, _, _) in st.reports.items() if k is not None and port.reported(h)]
    ran = sorted({k[0] for k in done if st.plan.tasks[k].updates or st.plan.tasks[k].stateful})
    if ran:
        return Fail(RefillError(f"{what} failed on {len(need.groups)} group(s) ({need.cause}), but {', '.join(ran)} "
                                f"of that step already ran, so it cannot run again with fresh prompts; use "
                                f"drop_group there"))
    key = group_column(port.graph, need.node)
    rows = failed_rows(need, st.plan, st.batch, key)
    fresh = keyed_draw(port.graph.config)(st.step, len(rows), rounds)
    port.rebatch(st, splice(st.batch, rows, fresh, st.step, rounds, key))
    rerun = port.resubmit_lost(set(), whole_first=True)
    st.faults["refilled_groups"] += len(rows)
    return Resubmitted(rerun)


__all__ = ["MAX_ROUNDS", "RefillError", "group_column", "keyed_draw", "refill", "refill_of", "refill_seed", "splice"]
