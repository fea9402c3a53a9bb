"""A reward model: a one-label sequence classifier scoring prompt + response.

The score of a sequence is the classifier's output at its last attended token
(the last response token: prompts are left-padded, responses right-padded).
The reward model is assumed to share the policy's tokenizer, so the rollout's
``input_ids`` are scored as they are.

Example::

    >>> from operators.models import load_model
    >>> rm, tok = load_model("builtin:tiny", head="reward")
    >>> scorer = RewardModelScorer(rm)
    >>> ids = torch.tensor([[0, 1, 20, 7, 11, 16, 7, 11, 2]])
    >>> scorer.score(ids, (ids != 0).long()).shape
    torch.Size([1])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedModel


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of ``attention_mask`` (0 for an all-zero row).

    Example::

        >>> last_token_index(torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]))
        tensor([2, 3])
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (attention_mask.bool() * positions).argmax(-1)


class RewardModelScorer:
    """Scores ``input_ids[B, T]`` with a sequence-classification model: ``rewards[B]``.

    Decoder classifiers with a ``score`` head (Llama, Qwen, Mistral...) are read
    per token and indexed at the last attended token, whatever the padding;
    other classifiers fall back to their own pooled logits.
    """

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()

    @torch.no_grad()
    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        head = getattr(self.model, "score", None)
        if isinstance(head, torch.nn.Module):
            hidden = self.model.base_model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).last_hidden_state
            per_token = head(hidden)[..., 0]
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)
            return per_token[rows, last_token_index(attention_mask)].float()
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits[:, 0].float()
