"""Images in a forward pass: a batch's processor tensors, and M-RoPE positions from the model itself.

A row of an image prompt carries ``multi_modal_inputs`` (verl's name and
layout): a dict of the processor's tensors for that row — ``pixel_values``
(one row per image patch, so rows differ in length) and ``image_grid_thw``
(one ``[t, h, w]`` per image). They ride a batch as one object per row and are
concatenated here, in row order, which is the order the model reads image
tokens in ``input_ids``.

Positions follow the model: a model with a ``get_rope_index`` (Qwen2-VL,
Qwen2.5-VL, PaddleOCR-VL) places image tokens on a ``(t, h, w)`` grid and text
after them, so the forward gets ``[3, B, T]`` positions from that function,
never the batch's 1-D ``position_ids``; text-only rows of such a model get
the same positions on all three axes.

Example::

    >>> from operators.models.tiny_vl import build_tiny_vl_model
    >>> model = build_tiny_vl_model()
    >>> ids = torch.tensor([[1, 4, 5, 5, 5, 5, 6, 26]])                # <bos> <vs> 4 image tokens <ve> ...
    >>> rope_positions(model, ids, torch.ones_like(ids), torch.tensor([[1, 4, 4]]))[:, 0].tolist()
    [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

#: the non-tensor column of per-row processor tensors (verl's ``multi_modal_inputs``)
MULTI_MODAL_INPUTS = "multi_modal_inputs"
#: its declaration, for operators that take it when the graph has it
VISION_FIELDS = {MULTI_MODAL_INPUTS: "object[B]"}
#: the logit of a token the policy never writes (exp underflows to 0 even after a temperature divides it)
NEVER = -1.0e9


@dataclass(frozen=True)
class VisionInputs:
    """The processor tensors of a batch's rows, concatenated in row order."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @classmethod
    def of_rows(cls, rows: Sequence[Mapping[str, torch.Tensor]]) -> "VisionInputs | None":
        """One value from per-row dicts; None when no row has an image."""
        rows = [r for r in rows if r and "pixel_values" in r]
        if not rows:
            return None
        return cls(torch.cat([r["pixel_values"] for r in rows]), torch.cat([r["image_grid_thw"] for r in rows]))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "VisionInputs":
        return VisionInputs(self.pixel_values.to(device=device, dtype=dtype), self.image_grid_thw.to(device))

    def model_kwargs(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What the model's forward takes, pixels in the model's dtype and device."""
        param = next(model.parameters())
        vision = self.to(param.device, param.dtype)
        return {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}


def vision_inputs(batch: Any) -> VisionInputs | None:
    """The images of a batch (a DataProto or a dict), or None for a text-only batch."""
    columns = getattr(batch, "non_tensor_batch", batch)
    if MULTI_MODAL_INPUTS not in columns:
        return None
    return VisionInputs.of_rows(list(columns[MULTI_MODAL_INPUTS]))


def vision_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids a vision-language model reads images into (image, video, vision start and end tokens); none for
    a text model. A response must not hold one: the model would look for a picture's features there."""
    config = getattr(model, "config", None)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({i for name in names if isinstance(i := getattr(config, name, None), int)})


def without_vision_tokens(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``logits[..., V]`` with the vision tokens out of reach: the policy of a vision-language model never
    writes one, in the rollout and in every forward alike (so their log-probs agree). A large finite
    value, not ``-inf``: their probability is exactly 0 and the entropy's ``p log p`` stays 0, not NaN."""
    banned = vision_token_ids(model)
    if not banned:
        return logits
    return logits.index_fill(-1, torch.tensor(banned, device=logits.device), NEVER)


def rope_index(model: torch.nn.Module):
    """The model's ``get_rope_index`` (on the model or its inner ``model``), or None for 1-D positions."""
    for owner in (model, getattr(model, "model", None)):
        if owner is not None and hasattr(owner, "get_rope_index"):
            return owner.get_rope_index
    return None


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """``int64[3, B, T]``: each token's (temporal, height, width) position from the model's rope index;
    padding gets 0. Raises for a model without one (it cannot place an image's grid)."""
    index = rope_index(model)
    if index is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index: flowrl places image tokens with "
                         f"the model's own rope index (Qwen2-VL, Qwen2.5-VL, PaddleOCR-VL have one)")
    image_token = model.config.image_token_id
    token_types = (input_ids == image_token).int()
    positions, _ = index(input_ids, mm_token_type_ids=token_types, image_grid_thw=image_grid_thw,
                         attention_mask=attention_mask)
    return positions


__all__ = ["MULTI_MODAL_INPUTS", "VISION_FIELDS", "VisionInputs", "rope_index", "rope_positions", "vision_inputs",
           "vision_token_ids", "without_vision_tokens"]
