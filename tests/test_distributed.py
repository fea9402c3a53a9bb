"""Training across a pool's ranks: FSDP2 on a gloo group of two Ray actors, against one process.

The two ranks are started once for the module (importing torch takes seconds
per process) and run the module's functions sent to them. Every result is
compared with a single process doing the same work — never FSDP with FSDP.
The tests that break the group (a hung and a killed rank) run last.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from flowrl.data import DataProto
from flowrl.data.balance import balance_ranks
from flowrl.data.dispatch import TASK_ROWS
from flowrl.data.metrics import total
from flowrl.store.checkpoint import CheckpointError, CheckpointStore
from flowrl.store.checkpoint_state import load_states, save_states
from flowrl.runtime.distributed import CollectiveError, PoolGroup, backend_for, listen
from flowrl.runtime.worker import RoleContext
from operators.models import OptimConfig, load_model, response_log_probs, response_values
from operators.models.data_parallel import LossNorm, data_parallel_forward
from operators.models.engine import TrainEngine, build_engine
from operators.models.export import ExportError, export_hf
from operators.models.fsdp import build_sharded, shard_model, state_bytes, unsharded
from operators.models.tiny import build_tiny_model
from operators.models.sharded_checkpoint import ModelState
from operators.roles import Actor, ActorConfig
from operators.rollout.base import SamplingParams

ray = pytest.importorskip("ray")

POOL = "train"
PROMPT, RESPONSE, ROWS = 4, 6, 8


# ---------------------------------------------------------------- the two ranks


class Rank:
    """One rank of the test pool: joins the group, runs the functions it is sent."""

    def __init__(self, rank: int):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        torch.set_num_threads(1)
        self.rank, self.state, self.listener = rank, {}, None

    def listen(self) -> str:
        self.listener = listen()
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def join(self, address: str, timeout_s: float) -> int:
        if "group" in self.state:  # a group the previous test left behind
            self.leave()
        self.state["group"] = PoolGroup.join(POOL, self.rank, 2, address, timeout_s=timeout_s,
                                             listener=self.listener)
        self.listener = None
        return os.getpid()

    def leave(self) -> None:
        self.state.pop("group").close()

    def run(self, fn, *args):
        return fn(self.state, *args)


def form_group(actors, timeout_s: float = 120.0) -> list[int]:
    address = ray.get(actors[0].listen.remote())
    return ray.get([a.join.remote(address, timeout_s) for a in actors])


@pytest.fixture(scope="module")
def ranks(ray_session):
    actors = [ray.remote(num_cpus=1)(Rank).remote(r) for r in range(2)]
    form_group(actors)
    yield actors
    for a in actors:  # the session's Ray has 2 CPUs: give them back to the other modules
        ray.kill(a)


def on_ranks(actors, fn, *per_rank_args):
    """``fn(state, *args)`` on both ranks; ``per_rank_args[i]`` is a list with one value per rank."""
    return ray.get([a.run.remote(fn, *(arg[r] for arg in per_rank_args)) for r, a in enumerate(actors)])


# ---------------------------------------------------------------- the batch and the loss


def make_batch(step: int) -> dict[str, torch.Tensor]:
    """Ragged responses: row i has a random number (1..RESPONSE) of real tokens."""
    gen = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(4, 29, (ROWS, PROMPT + RESPONSE), generator=gen)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=gen)
    response_mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), response_mask], dim=1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
            "advantages": torch.randn(ROWS, RESPONSE, generator=gen)}


def rows(batch: dict[str, torch.Tensor], index) -> dict[str, torch.Tensor]:
    index = torch.as_tensor(index)
    return {k: v[index] for k, v in batch.items()}


def micro_batches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    n = len(batch["input_ids"])
    return [rows(batch, list(range(s, min(s + size, n)))) for s in range(0, n, size)]


def pg_loss(model, mb, norm: LossNorm):
    """Token-mean policy-gradient loss over the whole mini-batch: sum over my tokens / global tokens."""
    positions = (mb["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    log_probs, _ = response_log_probs(model, mb["input_ids"], mb["attention_mask"], positions, RESPONSE)
    loss = -(log_probs * mb["advantages"] * mb["response_mask"]).sum() / norm.tokens
    return loss, {"loss": loss.detach()}


def rank_rows(step: int) -> list[list[int]]:
    batch = make_batch(step)
    return balance_ranks(batch["response_mask"].sum(-1).tolist(), world=2)


def step_on(engine: TrainEngine, mbs) -> dict:
    """One optimizer step of the engine over this process's micro-batches of a mini-batch."""
    engine.zero_grad()
    metrics = engine.forward_backward(mbs, lambda mb, nrm: pg_loss(engine.model, mb, nrm))
    return {**metrics, **engine.optimizer_step()}


def train(engine: TrainEngine, steps: int, pick, micro: int):
    """``steps`` data-parallel updates; ``pick(step)`` is this process's rows of the step's batch."""
    for step in range(steps):
        step_on(engine, micro_batches(rows(make_batch(step), pick(step)), micro))


def fresh(group=None, seed: int = 0, lr: float = 1e-3, grad_clip: float | None = 1.0) -> TrainEngine:
    """The engine a role builds: ``fsdp2`` over a group of two, ``local`` in one process."""
    model, _ = load_model("builtin:tiny", seed=seed)
    return build_engine(None, model, optim=OptimConfig(lr=lr, grad_clip=grad_clip), group=group)


def single_process(steps: int, micro: int, grad_clip, halves: bool) -> TrainEngine:
    """The reference: one process, the whole batch (or rank 0's rows then rank 1's)."""
    engine = fresh(PoolGroup.single(POOL), grad_clip=grad_clip)
    if halves:  # each rank's rows as one micro-batch, rank 0 first: what FSDP sums
        for step in range(steps):
            batch = make_batch(step)
            step_on(engine, [rows(batch, part) for part in rank_rows(step)])
    else:
        train(engine, steps, lambda step: list(range(ROWS)), micro)
    return engine


def proto_batch(step: int) -> DataProto:
    """:func:`make_batch` as the batch an update operator receives."""
    batch = make_batch(step)
    return DataProto.from_dict({**batch, "responses": batch["input_ids"][:, PROMPT:]})


def ppo_loss(engine: TrainEngine):
    def loss_fn(mb, norm):
        loss, _ = pg_loss(engine.model, mb, norm)
        return loss, {"pg_loss": total(loss.detach())}
    return loss_fn


# ---------------------------------------------------------------- functions run on the ranks


def _train_on_rank(state, steps, micro, grad_clip):
    group = state["group"]
    # different seeds per rank: only the broadcast from rank 0 makes them start equal
    engine = fresh(group, seed=group.rank, grad_clip=grad_clip)
    train(engine, steps, lambda step: rank_rows(step)[group.rank], micro)
    state["model"], state["optimizer"] = engine.model, engine.optimizer
    return engine.get_weights(), engine.held_bytes()


def _train_batches_on_rank(state, mini, epochs, micro):
    """Two updates through ``train_batch`` on this rank's balanced rows of each batch."""
    group = state["group"]
    engine = fresh(group, seed=group.rank)
    for step in range(2):
        part = rank_rows(step)[group.rank]
        mine = proto_batch(step)[part]
        mine.meta_info[TASK_ROWS] = (part, ROWS)  # what a balanced dispatch leaves on a rank's part
        metrics = engine.train_batch(mine, ppo_loss(engine), mini_batch_size=mini, epochs=epochs,
                                     micro_batch_size=micro)
    return engine.get_weights(), metrics


def _unsharded_rollout(state, ids):
    _train_on_rank(state, 3, ROWS, None)  # the weights of the bit-for-bit test
    group, model = state["group"], state["model"]
    mask = torch.ones_like(ids)
    before = state_bytes(model)["params"]
    with unsharded(model, group) as memory, torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return logits, out, memory, before, state_bytes(model)["params"]


def _save(state, path):
    """The checkpointer's worker side: the rank's shards under ``path``, its JSON tree back."""
    group = state["group"]
    return save_states(path, {"actor": ModelState(state["model"], state["optimizer"])}, group, group.rank)


def _load_and_step(state, path, trees, pick_rows):
    group = state["group"]
    engine = fresh(group, seed=7)
    load_states(path, {"actor": ModelState(engine.model, engine.optimizer)}, trees, group, group.rank)
    loaded = engine.get_weights()
    train_one(engine, pick_rows)
    return loaded, engine.get_weights()


def _checkpoint(run, trees, stage, graph):
    """A run's checkpoint after 2 steps, from the trees the ranks of pool ``train`` returned."""
    workers = {("train", r): {"roles": t, "versions": {}} for r, t in enumerate(trees)}
    CheckpointStore(run / "checkpoints").save(1, {"workers": workers, "weights": {}, "shards": str(stage)},
                                              meta={"graph": graph})


def train_one(engine: TrainEngine, pick_rows):
    step_on(engine, micro_batches(rows(make_batch(99), pick_rows), 3))


def _build_and_step(state):
    group = state["group"]
    model = build_sharded(lambda: build_tiny_model(seed=0 if group.rank == 0 else 5), group)
    engine = build_engine(None, model, optim=OptimConfig(lr=1e-3, grad_clip=1.0), group=group)
    built = engine.get_weights()
    train_one(engine, rank_rows(99)[group.rank])
    return built, engine.get_weights(), state_bytes(engine.model)


def _uneven_step_and_forward(state, my_rows):
    """Rank 0 holds 5 rows (3 micro-batches of 2), rank 1 holds 3 (2 micro-batches)."""
    group = state["group"]
    engine = fresh(group)
    mbs = micro_batches(rows(make_batch(7), my_rows), 2)
    step_on(engine, mbs)
    log_probs = data_parallel_forward(mbs, lambda mb: pg_log_probs(engine.model, mb), group)
    return engine.get_weights(), torch.cat(log_probs)


def pg_log_probs(model, mb):
    positions = (mb["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return response_log_probs(model, mb["input_ids"], mb["attention_mask"], positions, RESPONSE)[0]


def _values(state, ids):
    """The sharded critic's values (no grad), and the warnings a training forward/backward raised."""
    group = state["group"]
    critic, _ = load_model("builtin:tiny", head="value", seed=group.rank)
    critic = shard_model(critic, group)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = response_values(critic, ids, mask, mask.cumsum(-1) - 1, RESPONSE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        response_values(critic, ids, mask, mask.cumsum(-1) - 1, RESPONSE).sum().backward()
    return values, [str(w.message) for w in caught]


# ---------------------------------------------------------------- tests


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_rank_update_equals_one_process_on_the_whole_batch(ranks):
    (weights, bytes0), (none, bytes1) = on_ranks(ranks, _train_on_rank, [3, 3], [2, 2], [1.0, 1.0])
    assert none is None  # the full weights land on rank 0 only
    reference = single_process(steps=3, micro=ROWS, grad_clip=1.0, halves=False).get_weights()
    start, _ = load_model("builtin:tiny", seed=0)
    assert max_diff(reference, start.state_dict()) > 1e-3  # the steps moved the weights
    assert max_diff(weights, reference) <= 1e-5
    # each rank holds half of the parameters and of the optimizer state
    full = sum(v.numel() * 4 for v in start.parameters())
    for held in (bytes0, bytes1):
        assert held["params"] == pytest.approx(full / 2, rel=0.02)
        assert held["optimizer"] == pytest.approx(2 * full / 2, rel=0.02)


def test_two_rank_update_equals_one_process_accumulating_the_halves_bit_for_bit(ranks):
    (weights, _), _ = on_ranks(ranks, _train_on_rank, [3, 3], [ROWS, ROWS], [None, None])
    reference = single_process(steps=3, micro=ROWS, grad_clip=None, halves=True).get_weights()
    for k in reference:
        assert torch.equal(weights[k], reference[k]), k


@pytest.mark.parametrize("mini, epochs, micro", [(3, 2, 2), (5, 1, None)])
def test_two_rank_update_with_mini_batches_and_epochs_equals_one_process(ranks, mini, epochs, micro):
    # every mini-batch is cut from one permutation of the whole batch, so the ranks' parts of it are
    # exactly the rows one process takes (a rank may hold none of a mini-batch: it steps with no weight)
    (weights, metrics), (none, metrics1) = on_ranks(ranks, _train_batches_on_rank, [mini] * 2, [epochs] * 2,
                                                    [micro] * 2)
    engine = fresh(PoolGroup.single(POOL))
    for step in range(2):
        expected = engine.train_batch(proto_batch(step), ppo_loss(engine), mini_batch_size=mini, epochs=epochs,
                                      micro_batch_size=micro)
    reference = engine.get_weights()
    assert none is None and engine.updates == 2 * epochs * -(-ROWS // mini)
    assert max_diff(reference, load_model("builtin:tiny", seed=0)[0].state_dict()) > 1e-3
    assert max_diff(weights, reference) <= 1e-5
    for got in (metrics, metrics1):  # reduced over the ranks: every rank reports the whole mini-batches
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), k


def test_unsharded_rollout_runs_on_full_weights_and_reports_memory(ranks):
    ids = torch.tensor([[1, 20, 7, 11, 16], [1, 21, 8, 12, 16]])
    results = on_ranks(ranks, _unsharded_rollout, [ids, ids])
    model = single_process(steps=3, micro=ROWS, grad_clip=None, halves=True).model
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             do_sample=False, pad_token_id=0)
    full = sum(p.numel() * 4 for p in model.parameters())
    for got_logits, got_out, memory, before, after in results:
        assert float((got_logits - logits).abs().max()) <= 1e-5
        assert torch.equal(got_out, out)
        assert memory.full_bytes == full
        assert memory.taken_bytes == full - before > 0
        assert after == before and memory.freed_bytes == memory.taken_bytes  # resharded on exit


def test_ranks_with_different_micro_batch_counts_step_and_score_like_one_process(ranks):
    parts = [[0, 1, 2, 3, 4], [5, 6, 7]]
    (weights, lp0), (_, lp1) = on_ranks(ranks, _uneven_step_and_forward, parts)
    assert (len(lp0), len(lp1)) == (5, 3)  # one output row per real row: the padding passes are dropped
    engine = fresh()
    mbs = [rows(make_batch(7), list(range(ROWS)))]
    step_on(engine, mbs)
    assert max_diff(weights, engine.get_weights()) <= 1e-5
    with torch.no_grad():
        expected = pg_log_probs(engine.model, mbs[0])
    assert float((torch.cat([lp0, lp1]) - expected).abs().max()) <= 1e-5


def test_a_model_built_on_rank_0_only_trains_like_one_process(ranks):
    (built, stepped, held), (_, _, held1) = on_ranks(ranks, _build_and_step)
    engine = fresh()
    assert max_diff(built, engine.get_weights()) == 0.0
    train_one(engine, list(range(ROWS)))
    assert max_diff(stepped, engine.get_weights()) <= 1e-5
    full = sum(p.numel() * 4 for p in engine.model.parameters())
    for rank_held in (held, held1):
        assert rank_held["params"] == pytest.approx(full / 2, rel=0.02)


def test_sharded_value_model_gives_rank0_values(ranks):
    ids = make_batch(0)["input_ids"]
    results = on_ranks(ranks, _values, [ids, ids])
    critic, _ = load_model("builtin:tiny", head="value", seed=0)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = response_values(critic, ids, mask, mask.cumsum(-1) - 1, RESPONSE)
    for got, caught in results:
        assert float((got - expected).abs().max()) <= 1e-5
        # the root returns a fresh tensor: an in-place op on a view would skip FSDP2's pre-backward all-gather
        assert not [w for w in caught if "view" in w], caught


def test_checkpoint_written_by_two_ranks_loads_in_one(ranks, tmp_path):
    on_ranks(ranks, _train_on_rank, [3, 3], [2, 2], [1.0, 1.0])
    path = tmp_path / "staged"
    trees, _ = on_ranks(ranks, _save, [path, path])
    # both ranks take one more step; one process loads the 2-rank checkpoint and takes the same step
    parts = rank_rows(99)
    (loaded_on_ranks, stepped_on_ranks), _ = on_ranks(ranks, _load_and_step, [path, path], [trees, trees], parts)
    loaded, stepped = _load_and_step({"group": PoolGroup.single(POOL)}, path, trees, list(range(ROWS)))
    assert max_diff(loaded, loaded_on_ranks) == 0.0
    assert max_diff(stepped, stepped_on_ranks) <= 1e-5


def test_checkpoint_written_by_one_process_loads_in_two_ranks(ranks, tmp_path):
    engine = single_process(steps=2, micro=ROWS, grad_clip=1.0, halves=False)
    path = tmp_path / "staged"
    trees = _save({"model": engine.model, "optimizer": engine.optimizer, "group": PoolGroup.single(POOL)}, path)
    (loaded, stepped), _ = on_ranks(ranks, _load_and_step, [path, path], [trees, trees], rank_rows(99))
    assert max_diff(loaded, engine.get_weights()) == 0.0
    train_one(engine, list(range(ROWS)))
    assert max_diff(stepped, engine.get_weights()) <= 1e-5


def test_export_from_sharded_and_whole_checkpoints_gives_the_trained_logits(ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    reference = single_process(steps=2, micro=ROWS, grad_clip=1.0, halves=False)
    model, optimizer = reference.model, reference.optimizer
    graph = {"roles": {"actor": {"model": "builtin:tiny", "dtype": "float32"},
                       "ref": {"from": "actor", "frozen": True}}}
    # whole: one process
    trees = _save({"model": model, "optimizer": optimizer, "group": PoolGroup.single(POOL)}, tmp_path / "s1")
    _checkpoint(tmp_path / "whole", [trees], tmp_path / "s1", graph)
    # sharded: written by the two ranks
    (weights, _), _ = on_ranks(ranks, _train_on_rank, [2, 2], [2, 2], [1.0, 1.0])
    trees = on_ranks(ranks, _save, [tmp_path / "s2"] * 2)
    _checkpoint(tmp_path / "sharded", trees, tmp_path / "s2", graph)

    ids = make_batch(5)["input_ids"]
    for run, expected in ((tmp_path / "whole", model.state_dict()), (tmp_path / "sharded", weights)):
        state, meta, where = CheckpointStore(run / "checkpoints").read_role("actor", step=2)
        out = export_hf(state["model"], meta["graph"], tmp_path / f"hf_{run.name}", where=where)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        reference, _ = load_model("builtin:tiny")
        reference.load_state_dict(expected)
        with torch.no_grad():
            diff = (loaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max()
        assert float(diff) <= 1e-6
    with pytest.raises(CheckpointError, match="available steps: 2"):
        CheckpointStore(tmp_path / "whole" / "checkpoints").read_role("actor", step=7)
    with pytest.raises(CheckpointError, match="no role 'critic'"):
        CheckpointStore(tmp_path / "sharded" / "checkpoints").read_role("critic")
    with pytest.raises(ExportError, match="the graph has no role 'critic'"):
        export_hf(state["model"], meta["graph"], tmp_path / "x", role="critic")


# ---------------------------------------------------------------- failures (these break the group: last)


def _set_timeout(state, seconds):
    state["group"].set_timeout(seconds)


def _all_reduce(state, name):
    return state["group"].all_reduce(torch.ones(1), name=name)


def _sleep(state, seconds):
    time.sleep(seconds)


def _rollout_calls(state, calls):
    """A sharded actor's engine called ``calls`` times inside one full_weights() block, then a collective."""
    actor = Actor(ActorConfig(), RoleContext("actor", state["group"].rank, 2, 0, group=state["group"]))
    ids = torch.tensor([[1, 20, 7, 11, 16], [1, 21, 8, 12, 16]])
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    with actor.full_weights():
        outs = [actor.engine.generate(ids, torch.ones_like(ids), greedy)["responses"] for _ in range(calls)]
    return outs, actor.engine.memory, actor.get_weights()  # the group still meets: a gather after


def test_ranks_calling_the_rollout_engine_unequally_often_still_meet(ranks):
    # a multi-turn rollout's rounds differ from rank to rank: rank 0 calls once, rank 1 three times
    (outs0, memory, weights), (outs1, _, nothing) = on_ranks(ranks, _rollout_calls, [1, 3])
    single = Actor(ActorConfig(), RoleContext("actor", 0, 1, 0))
    ids = torch.tensor([[1, 20, 7, 11, 16], [1, 21, 8, 12, 16]])
    expected = single.engine.generate(ids, torch.ones_like(ids),
                                      SamplingParams(max_new_tokens=4, greedy=True))["responses"]
    assert len(outs0) == 1 and len(outs1) == 3
    assert all(torch.equal(out, expected) for out in outs0 + outs1)  # every call on the full weights
    assert memory.taken_bytes > 0 and memory.freed_bytes == memory.taken_bytes  # gathered once, given back
    assert nothing is None and all(torch.equal(weights[k], v) for k, v in single.model.state_dict().items())


def test_a_hung_rank_is_named_within_the_timeout(ranks):
    on_ranks(ranks, _set_timeout, [3.0, 3.0])
    start = time.monotonic()
    waiting = ranks[0].run.remote(_all_reduce, "advantage sum")
    sleeping = ranks[1].run.remote(_sleep, 6.0)
    with pytest.raises(CollectiveError) as err:
        ray.get(waiting)
    assert time.monotonic() - start < 30
    assert (err.value.pool, err.value.rank) == (POOL, 0)
    assert err.value.collective.startswith("advantage sum")
    assert "rank 1 never reached it" in err.value.reason
    ray.get(sleeping)
    ray.get([a.leave.remote() for a in ranks])


def test_a_killed_rank_is_named_within_the_timeout(ranks):
    pids = form_group(ranks)
    on_ranks(ranks, _set_timeout, [20.0, 20.0])
    start = time.monotonic()
    waiting = ranks[0].run.remote(_all_reduce, "grad norm")
    ranks[1].run.remote(_sleep, 60.0)
    time.sleep(1.0)
    ray.kill(ranks[1])
    with pytest.raises(CollectiveError) as err:
        ray.get(waiting)
    assert time.monotonic() - start < 20
    assert (err.value.pool, err.value.rank) == (POOL, 0)
    assert f"rank 1 (pid {pids[1]}) is dead" in err.value.reason


def test_a_pool_of_one_needs_no_group_and_backend_strings_are_checked():
    group = PoolGroup.single(POOL)
    assert float(group.all_reduce(torch.tensor([3.0]))) == 3.0 and group.mesh is None
    assert backend_for("cpu:gloo,cuda:nccl") == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "cpu:gloo")
    with pytest.raises(ValueError, match="not 'device:backend'"):
        backend_for("gloo")


def test_balance_ranks_keeps_groups_whole_and_tokens_even():
    tokens = [30, 1, 1, 1, 10, 10, 10, 10, 5, 5, 5, 5]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    parts = balance_ranks(tokens, 2, groups)
    assert sorted(sum(parts, [])) == list(range(12))
    for g in (0, 1, 2):
        assert sum(all(r in p for r in range(4 * g, 4 * g + 4)) for p in parts) == 1
    loads = sorted(sum(tokens[i] for i in p) for p in parts)
    assert loads == [40, 53]  # the best split with whole groups: {40} | {33, 20}
    assert balance_ranks([5, 4, 3, 3, 2, 1], 3) == [[0, 5], [1, 4], [2, 3]]


def test_export_cli_writes_a_loadable_directory_and_names_a_missing_step(tmp_path):
    from typer.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from flowrl.cli import app

    reference = single_process(steps=1, micro=ROWS, grad_clip=1.0, halves=False)
    model, optimizer = reference.model, reference.optimizer
    trees = _save({"model": model, "optimizer": optimizer, "group": PoolGroup.single(POOL)}, tmp_path / "s")
    _checkpoint(tmp_path / "run", [trees], tmp_path / "s", {"roles": {"actor": {"model": "builtin:tiny"}}})
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert ok.exit_code == 0, ok.output
    ids = make_batch(3)["input_ids"]
    with torch.no_grad():
        diff = (AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))(input_ids=ids).logits
                - model(input_ids=ids).logits).abs().max()
    assert float(diff) <= 1e-6
    bad = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "x"), "--step", "5"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
