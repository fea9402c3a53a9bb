"""The critic: a causal-LM backbone with a scalar value head on every token."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedModel

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """``values[b, t] = w · h[b, t] + c``, with ``h`` the backbone's last hidden state.

    ``backbone`` is a transformers base model (``LlamaModel``, ``AutoModel``...)
    returning ``last_hidden_state``. Build one with
    :func:`operators.models.load_model` (``head="value"``) rather than directly.

    Example::

        >>> from operators.models import load_model
        >>> critic, tok = load_model("builtin:tiny", head="value")
        >>> ids = torch.tensor([[1, 20, 7, 11, 16]])
        >>> mask = torch.ones_like(ids)
        >>> critic(ids, mask, mask.cumsum(-1) - 1).shape
        torch.Size([1, 5])
    """

    def __init__(self, backbone: PreTrainedModel, head_seed: int = 0):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        hidden = backbone.config.hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=backbone.dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(head_seed)
            nn.init.normal_(self.value_head.weight, std=0.02)
        nn.init.zeros_(self.value_head.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.value_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        # w · h + c straight to [B, T]: a fresh tensor, not a view of the head's [B, T, 1] output
        # (an FSDP2 root must not return a view; in float32 `.float()` would not copy it)
        return (hidden @ self.value_head.weight[0] + self.value_head.bias).float()

    def save_pretrained(self, path: str | Path) -> None:
        """Write the backbone as a HF directory plus ``value_head.safetensors`` beside it."""
        path = Path(path)
        self.backbone.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()},
                  str(path / VALUE_HEAD_FILE))

    def load_value_head(self, path: str | Path) -> bool:
        """Load ``value_head.safetensors`` from ``path`` if it is there; say whether it was."""
        file = Path(path) / VALUE_HEAD_FILE
        if not file.is_file():
            return False
        self.value_head.load_state_dict(load_file(str(file)))
        return True
