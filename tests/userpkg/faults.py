"""Operators that misbehave on purpose, for tests of how a run fails."""

import torch

from flowrl.graph import operator


@operator("userpkg.nan_reward", scope="row",
          inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]", "uid": "object[B]"},
          outputs={"token_level_scores": "float32[B, R]"}, node_name="reward", score="token_level_scores")
def nan_reward(batch, p):
    """Fine at the first step; NaN from the second on (uids are '<step>-<i>')."""
    second = any(not str(u).startswith("0-") for u in batch["uid"])
    scores = torch.full(batch["responses"].shape, float("nan") if second else 0.0)
    return {"token_level_scores": scores}


@operator("userpkg.ragged_reward", scope="row",
          inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]"},
          outputs={"token_level_scores": "float32[B, R]", "response_mask_copy": "int64[B, R]"},
          node_name="reward")
def ragged_reward(batch, p):
    """Returns scores one token longer than the responses: R disagrees between its outputs."""
    b, r = batch["responses"].shape
    return {"token_level_scores": torch.zeros(b, r + 1), "response_mask_copy": batch["response_mask"]}


@operator("userpkg.short_reward", scope="row",
          inputs={"responses": "int64[B, R]", "response_mask": "int64[B, R]"},
          outputs={"token_level_scores": "float32[B, R]"}, node_name="reward")
def short_reward(batch, p):
    """Drops the last row: one output row fewer than it was given."""
    return {"token_level_scores": torch.zeros_like(batch["responses"][:-1], dtype=torch.float32)}
