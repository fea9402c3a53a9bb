"""The plan says everything a step will run: reads, rows, dispatch, gates, syncs."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph import load_graph, operator
from flowrl.data.dispatch import RowKeys
from flowrl.plan.planner import PlanError, make_plan
from flowrl.plan.staleness import Gate
from flowrl.plan.traits import LOCAL, RAY

SEQUENCE = {"input_ids": "int64[B, T]", "attention_mask": "int64[B, T]"}


@operator("test.plan_group_forward", role="actor", role_kinds=("actor",), scope="group", inputs=SEQUENCE,
          outputs={"group_score": "float32[B]"}, node_name="group_score", balance_by="attention_mask")
def group_forward(actor, batch, p):
    """A forward pass that needs whole groups, but declares no key to know them."""
    return {"group_score": torch.zeros(len(batch))}


@operator("test.plan_group_forward_uid", role="actor", role_kinds=("actor",), scope="group",
          inputs={**SEQUENCE, "uid": "object[B]"}, outputs={"group_score": "float32[B]"}, node_name="group_score",
          balance_by="attention_mask", group_key="uid")
def group_forward_uid(actor, batch, p):
    """A forward pass that needs whole groups and declares their key."""
    return {"group_score": torch.zeros(len(batch))}


def test_every_task_has_its_reads_dispatch_gates_and_syncs():
    plan = make_plan(load_graph("grpo_async"))
    gen = plan.tasks[("generate", None)]
    assert gen.factor == 8 and gen.dispatch == "split" and gen.ranks == (0,)
    # one step off: generate at step t waits for the update of step t-2 and loads it into the rollout role
    assert gen.gates == (Gate("actor", "update_actor", "generate", 1, "rollout"),)
    assert gen.syncs == gen.gates and gen.gates[0].update_step(5) == 3 and gen.gates[0].min_version(5) == 4
    reward = plan.tasks[("reward", None)]
    data_read = next(r for r in reward.reads if r.srcs == (("data", None),))
    assert data_read.repeat == 8  # prompt columns repeated to the 8 samples of each prompt
    update = plan.tasks[("update_actor", None)]
    assert (update.updates, update.publishes, update.dispatch) == ("actor", True, "all")


def test_two_workers_split_rows_and_an_update_runs_on_every_rank():
    plan = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}))
    old = plan.tasks[("old_logprob", 0)]
    assert (old.ranks, old.collected, old.world) == ((0, 1), (0, 1), 2)
    update = plan.tasks[("update_actor", None)]
    # the ranks form a process group: data parallel, each rank its balanced share, all report
    assert (update.ranks, update.collected, update.dispatch) == ((0, 1), (0, 1), "balanced")
    assert plan.tasks[("advantage", None)].ranks == (0,)  # a driver node runs once
    # threads sharing one process (the local backend) form no group: each rank the whole batch
    local = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}), LOCAL)
    update = local.tasks[("update_actor", None)]
    assert (update.ranks, update.collected, update.dispatch) == ((0, 1), (0,), "all")
    # the ranks that gather the update's weights: the whole group on ray, rank 0 alone on threads
    assert (plan.tasks[("update_actor", None)].gather, update.gather) == (2, 1)


def dispatch_of(plan) -> dict[str, str]:
    modes = {node: {t.dispatch for t in plan.node_tasks(node)} for node in plan.graph.nodes}
    assert all(len(m) == 1 for m in modes.values())  # one mode for every task of a node
    return {node: m.pop() for node, m in modes.items()}


def test_forward_passes_on_a_data_parallel_pool_balance_real_tokens_and_generation_keeps_prompts_whole():
    plan = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}))
    modes = dispatch_of(plan)
    # log-probs read attention_mask and keep their rows: balanced by real tokens, every micro-batch
    assert (modes["old_logprob"], modes["ref_logprob"], modes["update_actor"]) == ("balanced",) * 3
    assert len(plan.node_tasks("old_logprob")) == 2
    # generation expands each prompt ×4: split, so all samples of a prompt stay on one rank
    assert modes["generate"] == "split" and "×4" in plan.dispatch_rules["generate"]
    assert "real tokens (attention_mask)" in plan.dispatch_rules["old_logprob"]
    # the critic's pool has one worker: its nodes run as declared
    assert (modes["values"], modes["update_critic"]) == ("split", "all")
    # no process group (the local backend): forward passes split as declared
    local = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2}), LOCAL)
    assert (dispatch_of(local)["old_logprob"], dispatch_of(local)["ref_logprob"]) == ("split", "split")
    assert "local backend's ranks form no process group" in local.dispatch_rules["old_logprob"]
    # the column that counts real tokens comes from the operator's declaration, renamed as the node renames it
    assert plan.tasks[("old_logprob", 0)].keys == RowKeys(tokens="attention_mask")
    renamed = make_plan(load_graph("ppo", overrides={"pools.train.workers": 2,
                                                     "nodes.old_logprob.inputs": {"attention_mask": "mask2"}}), RAY)
    assert renamed.tasks[("old_logprob", 0)].keys == RowKeys(tokens="mask2")


def test_a_micro_batch_smaller_than_the_pool_keeps_split():
    # 4 prompts in 4 micro-batches, n=1: one row per task of old_logprob on the 2 train ranks, nothing to
    # balance (generation on its own 1-worker pool)
    g = load_graph("grpo_async", overrides={"pools.train.workers": 2, "data.batch_size": 4,
                                            "schedule.micro_batches": 4, "nodes.generate.n": 1,
                                            "nodes.old_logprob.op": "logprob.old",
                                            "nodes.update_actor.inputs": {}})
    plan = make_plan(g)
    assert dispatch_of(plan)["old_logprob"] == "split"
    assert "(1) than ranks (2)" in plan.dispatch_rules["old_logprob"]
    assert dispatch_of(make_plan(g, micro_batches=2))["old_logprob"] == "balanced"


def test_a_rollout_that_would_leave_a_rank_without_prompts_is_refused():
    # 8 prompts in 8 micro-batches on 2 ranks: one rank would sample from nothing (it failed at run time)
    g = load_graph("grpo", overrides={"pools.train.workers": 2, "data.batch_size": 8, "schedule.micro_batches": 8})
    with pytest.raises(PlanError, match="node 'generate' .* 2 workers of pool 'train'.* only 1 row:"):
        make_plan(g)
    assert make_plan(g, micro_batches=4).micro_batches == 4


def test_flowrl_plan_prints_the_tasks(capsys):
    from rich.console import Console

    from visualizer.plan import render_tasks

    plan = make_plan(load_graph("grpo_async"))
    console = Console(width=300, record=True)
    console.print(render_tasks(plan, {}))
    text = console.export_text()
    assert "load rollout ← actor@t-2" in text and "32 → 256" in text


def test_a_group_scoped_forward_keeps_groups_whole_and_must_read_their_uid():
    two = {"pools.train.workers": 2}
    plan = make_plan(load_graph("ppo", overrides={**two, "nodes.group_score.op": "test.plan_group_forward_uid"}))
    assert dispatch_of(plan)["group_score"] == "balanced_groups"
    assert "uid groups whole" in plan.dispatch_rules["group_score"]
    assert plan.tasks[("group_score", 0)].keys == RowKeys(tokens="attention_mask", groups="uid")
    with pytest.raises(PlanError, match="node 'group_score' is group-scoped .* declares no group_key"):
        make_plan(load_graph("ppo", overrides={**two, "nodes.group_score.op": "test.plan_group_forward"}))


def test_an_update_with_fewer_rows_than_ranks_is_refused_before_it_runs():
    # 1 prompt × 2 samples (generated on their own pool) over 4 data-parallel ranks: two ranks would get
    # no row and stall the others
    g = load_graph("grpo_async", overrides={"pools.train.workers": 4, "pools.train.cpus": 0.25,
                                            "data.batch_size": 1, "nodes.generate.n": 2})
    with pytest.raises(PlanError) as err:
        make_plan(g)
    text = str(err.value)
    assert "'update_actor'" in text and "only 2 rows" in text and "pools.train.workers" in text
    assert make_plan(g, LOCAL).tasks[("update_actor", None)].dispatch == "all"  # threads: each rank all rows
    # as many rows as ranks is enough
    assert make_plan(load_graph("grpo_async", overrides={"pools.train.workers": 4, "pools.train.cpus": 0.25,
                                                         "data.batch_size": 2, "nodes.generate.n": 2}))


def test_the_plan_carries_role_builds_statefulness_and_the_validation_run():
    g = load_graph("ppo", overrides={"trainer.val_every": 2, "nodes.kl_reward": {"op": "kl.adaptive_reward"}})
    plan = make_plan(g, LOCAL)
    builds = {p.name: [(b.name, b.kind, b.shares, b.frozen) for b in p.roles] for p in plan.pools}
    # the frozen reference gets a model of its own, built from the actor's settings
    assert builds == {"train": [("actor", "actor", None, False), ("ref", "actor", None, True)],
                      "critic": [("critic", "critic", None, False)]}
    assert plan.tasks[("kl_reward", None)].stateful and not plan.tasks[("advantage", None)].stateful
    # validation is a second plan: the scoring sub-graph, one micro-batch, no gates, the same backend
    val = plan.validation
    assert (val.kind, list(val.graph.nodes), val.micro_batches, val.traits) == ("val", ["generate", "reward"], 1, LOCAL)
    assert val.validation is None and not any(t.gates for t in val.tasks.values())
    assert plan.runs() == [plan, val] and plan.driver
    assert make_plan(load_graph("ppo")).validation is None  # trainer.val_every: 0
