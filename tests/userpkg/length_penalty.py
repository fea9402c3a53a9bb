"""A user's own operator, plugged into a graph by import path with no change to flowrl."""

from pydantic import Field

from flowrl.graph import Params, operator


class LengthPenalty(Params):
    coef: float = Field(0.01, ge=0, description="penalty per response token")


@operator(
    "userpkg.length_penalty",
    inputs={"token_level_scores": "float32[B, R]", "response_mask": "int64[B, R]"},
    outputs={"token_level_rewards": "float32[B, R]"},
    params=LengthPenalty,
    node_name="length_penalty",
    headline=("reward/length_penalty",),  # the live view shows it
)
def length_penalty(batch, p: LengthPenalty):
    mask = batch["response_mask"].float()
    length = mask.sum(-1, keepdim=True)
    last = mask * (mask.cumsum(-1) == length).float()  # the last valid token of each row
    penalty = p.coef * length
    return {"token_level_rewards": batch["token_level_scores"] - penalty * last}, {
        "reward/length_penalty": penalty.mean()}
