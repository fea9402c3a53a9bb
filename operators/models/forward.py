"""Forward passes the actor, reference and critic share: per-response-token log-probs and values.

Both read the full sequence (``input_ids = prompts ‖ responses``) and keep the
last ``R`` positions that predict response tokens: the output at position
``t`` belongs to the token at ``t + 1``, so response token ``j`` is read at
``P - 1 + j``.

Example::

    >>> from operators.models import load_model
    >>> policy, tok = load_model("builtin:tiny")
    >>> ids = torch.tensor([[1, 20, 7, 11, 16, 7, 11, 2]])       # prompt (5) ‖ response (3)
    >>> mask = torch.ones_like(ids)
    >>> log_probs, entropy = response_log_probs(policy, ids, mask, mask.cumsum(-1) - 1,
    ...                                         response_length=3, with_entropy=True)
    >>> log_probs.shape, entropy.shape
    (torch.Size([1, 3]), torch.Size([1, 3]))
"""

from __future__ import annotations

import torch

from operators.algos.functional import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs[B, R], entropy[B, R] or None)`` of the response tokens under ``softmax(logits / T)``.

    Gradients flow unless the caller wraps it in ``torch.no_grad()`` (old/ref log-probs).
    Use the rollout's temperature, so the result matches ``rollout_log_probs``.
    """
    logits = response_logits(model, input_ids, attention_mask, position_ids, response_length, temperature)
    log_probs = logprobs_from_logits(logits, input_ids[:, -response_length:])
    return log_probs, entropy_from_logits(logits) if with_entropy else None


def response_log_probs_and_sum_pi_squared(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs[B, R], sum_pi_squared[B, R])``: also ``Σ_v π(v)²`` at each response token, as verl's
    ``actor.calculate_sum_pi_squared`` gives it (same temperature-scaled distribution), from one forward."""
    logits = response_logits(model, input_ids, attention_mask, position_ids, response_length, temperature)
    return logprobs_from_logits(logits, input_ids[:, -response_length:]), sum_pi_squared_from_logits(logits)


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``logits[B, R, V] / T`` in fp32 at the positions that predict the response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    temperature = temperature if temperature > 0 else 1.0  # greedy rollouts report T = 1 log-probs
    return logits[:, -response_length - 1:-1].float() / temperature


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """``values[B, R]``: the critic's value of the state before each response token."""
    values = critic(input_ids, attention_mask, position_ids)
    return values[:, -response_length - 1:-1]
