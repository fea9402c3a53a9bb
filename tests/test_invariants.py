"""Invariants checked every step: each sabotage is caught at the step it happens, naming the node."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from flowrl.graph import load_graph, operator
from flowrl.errors import NodeError
from flowrl.provenance.invariants import InvariantError
from flowrl.provenance.rundiff import read_prints
from flowrl.run.trainer import Trainer
from operators.models.engine import TrainEngine
from operators.roles import TrainableRole
from rich.console import Console
from visualizer.live import LiveView

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}
_calls = itertools.count()


@operator("test.nan_at_second_call", scope="group", group_key="uid", node_name="advantage",
          inputs={"token_level_rewards": "float32[B, R]", "response_mask": "int64[B, R]", "uid": "object[B]"},
          outputs={"advantages": "float32[B, R]", "returns": "float32[B, R]"}, token_mask="response_mask")
def nan_at_second_call(batch, p):
    """Zero advantages; on its second call (step 2) row 2 holds a NaN."""
    adv = torch.zeros(batch["token_level_rewards"].shape)
    if next(_calls) == 1:
        adv[2, 1] = float("nan")
    return {"advantages": adv, "returns": adv.clone()}


@operator("test.erroring_reward", inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]"},
          outputs={"token_level_scores": "float32[B, R]"}, node_name="reward", score="token_level_scores")
def erroring_reward(batch, p):
    """Every scoring call failed, and each failure was scored 0."""
    n = len(batch["responses"])
    return {"token_level_scores": torch.zeros(batch["responses"].shape)}, {"reward/errors": float(n)}


def _run(tmp_path, name, steps, sets=None, fatal=False, view=None):
    said: list[str] = []
    g = load_graph(name, overrides={**TINY, **(sets or {}), "trainer.invariants": "fatal" if fatal else "warn"})

    def say(message):
        said.append(message)
        if view is not None:  # as flowrl run wires it: the trainer says through the live view
            view.say(message)

    Trainer(g, backend="local", steps=steps, out=tmp_path, say=say).run()
    _, records = read_prints(tmp_path)
    return {r["step"]: r["invariants"] for r in records}, said


def test_a_clean_run_breaks_no_invariant(tmp_path):
    found, said = _run(tmp_path, "grpo_async", 3)
    assert found == {1: [], 2: [], 3: []} and not [m for m in said if m.startswith("invariant")]


def test_a_nan_injected_in_one_operator_is_named_with_node_field_step_and_row(tmp_path):
    with pytest.raises(NodeError) as err:
        _run(tmp_path, "grpo", 3, {"nodes.advantage": {"op": "test.nan_at_second_call",
                                             "inputs": {"token_level_rewards": "token_level_scores"}}})
    e = err.value
    assert (e.node, e.step) == ("advantage", 1)  # 0-based: the second step
    assert "advantages (first at row 2 of 8)" in str(e)


def test_an_update_that_never_reached_the_model_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainEngine, "train_batch", lambda self, batch, loss_fn, **kw: {})
    view = LiveView(load_graph("grpo"), total_steps=2, console=Console(file=io.StringIO(), width=120))
    found, said = _run(tmp_path, "grpo", 2, view=view)
    assert [(f["name"], f["node"]) for f in found[1]] == [("weights_unchanged", "update_actor")]
    assert any(m.startswith("invariant weights_unchanged: step 1, node 'update_actor'") for m in said)
    # the live view marks the node where it fired, and only that one
    assert view.fired == {"update_actor": "weights_unchanged"}
    rec = Console(width=120, record=True, color_system=None, file=io.StringIO())
    rec.print(view.render())
    marked = [line.split()[1] for line in rec.export_text().splitlines()
              if line[:1].isdigit() and " invariant " in line]
    assert marked == ["update_actor"]


def _drop_one_tensor(self, weights):
    """A push that silently leaves one tensor behind (not the embeddings: lm_head, tied to them, loads them)."""
    dropped = next(k for k in weights if "q_proj" in k)
    self.model.load_state_dict({k: v for k, v in weights.items() if k != dropped}, strict=False)


def test_a_weight_push_that_drops_one_tensor_is_caught_where_it_lands(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainableRole, "set_weights", _drop_one_tensor)
    found, _ = _run(tmp_path, "grpo_async", 3)
    # staleness 1: step 3 is the first to load weights from the train pool (those of step 1's update)
    assert found[1] == found[2] == []
    names = {(f["name"], f["node"]) for f in found[3]}
    assert ("weights_arrived_different", "sync:rollout") in names
    assert ("weights_not_as_planned", "generate") in names  # and generation ran on them
    with pytest.raises(InvariantError, match="at step 3"):
        _run(tmp_path / "fatal", "grpo_async", 4, fatal=True)


def test_a_rollout_on_stale_weights_under_a_new_version_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(TrainableRole, "set_weights", lambda self, weights: None)  # the version moves, weights don't
    found, _ = _run(tmp_path, "grpo_async", 3)
    stale = [f for f in found[3] if f["name"] == "weights_not_as_planned"]
    assert [f["node"] for f in stale] == ["generate"] and "version 1" in stale[0]["message"]


def test_errors_scored_as_one_value_for_the_whole_batch_are_caught(tmp_path):
    found, _ = _run(tmp_path, "grpo", 1, {"nodes.reward": {"op": "test.erroring_reward"}})
    (f,) = found[1]
    assert (f["name"], f["node"], f["field"]) == ("constant_on_errors", "reward", "token_level_scores")


@pytest.mark.parametrize("graph, pool, role, planned", [("ppo.yaml", "train", "actor", 1),
                                                         ("async.yaml", "gen", "rollout", 0)])
def test_a_task_on_weights_of_another_version_than_planned_fails_the_step(graph, pool, role, planned):
    """A version count that jumped (here a load that carries the wrong version) is named at the next
    step, whether the weights come from the updater's own pool or are loaded from another one."""
    from flowrl.plan.staleness import VersionNotPlanned
    from flowrl.runtime.scheduler import Runtime
    from tests.test_runtime import BIG, HERE, batches

    with Runtime(load_graph(HERE / "data" / graph), backend="local", resources=BIG) as rt:
        source = batches(4)
        rt.run_step(next(source), step=0)
        weights, version = rt.backend.get(rt.backend.call(pool, 0, "get_weights", role))
        rt.backend.get(rt.backend.call(pool, 0, "set_weights", role, (weights, planned + 5)))
        with pytest.raises(VersionNotPlanned, match=rf"at step 2 ran on weight version {planned + 5} of role "
                                                    rf"'{role}' on {pool}\[0\].*use version {planned} "):
            rt.run_step(next(source), step=1)
