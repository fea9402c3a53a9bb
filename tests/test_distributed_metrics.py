"""Every metric of an actor update on two ranks equals one process's on the whole batch.

A metric reduces over the micro-batches of a mini-batch and over the ranks
that hold its rows, each by the reduction declared where the metric is made (a
mean over tokens, over sequences, a sum, a max). A wrong weight shows only
when the ranks hold unequal rows of unequal lengths: here rank 0 holds seven
rows and rank 1 three, responses of 1 to 6 tokens, and rollout correction
(TIS, IcePop, MIS and verl's divergence rejections) is on. The ranks (FSDP2
over gloo) are spawned once for the module (``tests.test_distributed``'s
fixture); the reference is one process, never FSDP against FSDP.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.data import DataProto
from flowrl.data.dispatch import TASK_ROWS
from flowrl.runtime.worker import RoleContext
from operators import actor as actor_ops
from operators import logprob
from operators.roles import Actor, ActorConfig
from tests.test_distributed import on_ranks, ranks  # noqa: F401  (the module's two ranks)

PROMPT, RESPONSE, ROWS = 4, 6, 10
#: the rows each rank holds: unequal counts and token totals
SPLIT = [[0, 2, 3, 5, 6, 8, 9], [1, 4, 7]]
TOLERANCE = 1e-5

UPDATES = {
    "sequence TIS, divergence rejection, KL loss, mini-batches and epochs": dict(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k3,seq_mean_k2",
        rollout_rs_threshold="0.5_2.0,0.5,0.1", use_kl_loss=True, entropy_coeff=0.01, mini_batch_size=4,
        micro_batch_size=2, epochs=2),
    "IcePop, sequence MIS, seq-mean-token-mean": dict(
        rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="sequence", rollout_rs_threshold=3.0,
        loss_agg_mode="seq-mean-token-mean", micro_batch_size=3),
}


def fresh_actor(group=None) -> Actor:
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    return Actor(ActorConfig(optim={"lr": 1e-3, "grad_clip": 1.0}), RoleContext("actor", rank, world, 0, group=group))


def update_batch() -> DataProto:
    """Ragged responses with π_old from the actor's initial weights, a sampler that disagrees with it
    by up to ±0.6 per token, a reference a little off, random advantages."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 1, 4, 2, 6, 3, 5, 1, 6, 2])
    response_mask = (torch.arange(RESPONSE)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(4, 29, (ROWS, PROMPT + RESPONSE), generator=gen)
    attention_mask = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), response_mask], dim=1)
    batch = DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "responses": input_ids[:, PROMPT:],
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "response_mask": response_mask,
        "advantages": torch.randn(ROWS, RESPONSE, generator=gen)})
    old = logprob.old(fresh_actor(), batch).batch["old_log_probs"]
    noise = (torch.rand(ROWS, RESPONSE, generator=gen) * 1.2 - 0.6) * response_mask
    return batch.union(DataProto.from_dict({
        "old_log_probs": old, "rollout_log_probs": old - noise,
        "ref_log_prob": old + 0.1 * torch.randn(ROWS, RESPONSE, generator=gen) * response_mask}))


def _update_on_rank(state, part: DataProto, params: dict) -> dict[str, float]:
    actor = fresh_actor(state["group"])
    return dict(actor_ops.update(actor, part, **params).meta_info["metrics"])


@pytest.fixture(scope="module")
def batch() -> DataProto:
    return update_batch()


@pytest.mark.parametrize("params", list(UPDATES.values()), ids=list(UPDATES))
def test_every_metric_of_a_two_rank_update_equals_one_process(ranks, batch, params):  # noqa: F811
    parts = []
    for rows in SPLIT:  # what a balanced dispatch hands each rank
        part = batch[torch.tensor(rows)]
        part.meta_info = {**part.meta_info, TASK_ROWS: (rows, ROWS)}  # (an index shares the batch's meta_info)
        parts.append(part)
    per_rank = on_ranks(ranks, _update_on_rank, parts, [params, params])
    expected = dict(actor_ops.update(fresh_actor(), batch, **params).meta_info["metrics"])
    assert expected["actor/rollout_corr/rs_masked_fraction"] > 0  # the rejection bites on these rows
    assert expected["actor/rollout_corr/seq_log_ratio_abs_mean"] > 0.1
    for got in per_rank:  # every rank reports the whole update
        assert sorted(got) == sorted(expected)
        off = {k: (got[k], expected[k]) for k in expected if abs(got[k] - expected[k]) > TOLERANCE}
        assert not off, off
