"""Forward passes the actor, reference and critic share: per-response-token log-probs and values.

Both read the full sequence (``input_ids = prompts ‖ responses``) and keep the
last ``R`` positions that predict response tokens: the output at position
``t`` belongs to the token at ``t + 1``, so response token ``j`` is read at
``P - 1 + j``.

Padding is not paid for: when each row's real tokens are one run (left-padded
prompt ‖ right-padded response, as rollouts make them), the rows are shifted
to start at column 0 and cut to the longest row, so the model runs plain
causal attention (no mask to build or apply) over real columns only, and the
LM head runs only on the positions that predict a response token, a chunk of
tokens at a time, so a large vocabulary never costs every position's logits at
once. Real positions get the same values as a masked full-width pass, up to
float reordering; response positions past a row's last token come back as 0
logits (0 values), so a row's outputs do not depend on the rows beside it.

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

from dataclasses import dataclass

import torch

from operators.algos import functional
from operators.algos.functional import chunked_token_stats
from operators.models.fsdp import is_dtensor
from operators.models.vision import VisionInputs, rope_positions, without_vision_tokens


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    vision: VisionInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs[B, R], entropy[B, R] or None)`` of the response tokens under ``softmax(logits / T)``.

    Gradients flow unless the caller wraps it in ``torch.no_grad()`` (old/ref log-probs).
    Use the rollout's temperature, so the result matches ``rollout_log_probs``.
    ``entropy_grad=False``: the entropy is a metric only, computed without a graph
    (a full-vocabulary softmax the backward pass need not visit).
    ``vision``: the rows' images (:func:`~operators.models.vision.vision_inputs`), for a vision-language model.
    The LM head runs a chunk of tokens at a time (:func:`~operators.algos.functional.chunked_token_stats`):
    a 49k vocabulary never costs ``B × R × V`` fp32 logits at once.
    """
    log_probs, entropy, _ = _response_stats(model, input_ids, attention_mask, position_ids, response_length,
                                            temperature, vision, with_entropy=with_entropy,
                                            entropy_grad=entropy_grad)
    return log_probs, entropy


def response_log_probs_and_sum_pi_squared(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    vision: VisionInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs[B, R], sum_pi_squared[B, R])``: also ``Σ_v π(v)²`` at each response token, as verl's
    ``actor.calculate_sum_pi_squared`` gives it (same temperature-scaled distribution), from one forward."""
    log_probs, _, sum_pi_squared = _response_stats(model, input_ids, attention_mask, position_ids, response_length,
                                                   temperature, vision, with_sum_pi_squared=True)
    return log_probs, sum_pi_squared


def _response_stats(model, input_ids, attention_mask, position_ids, response_length, temperature, vision,
                    **which: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    head = lm_head(model)
    whole = input_ids.shape[0] * response_length * head.vocab_size <= functional.LOGITS_CHUNK_ELEMENTS
    if whole or is_dtensor(head.linear.weight):
        # logits that fit in one chunk come from the model's own forward, the same computation on one
        # process and on N sharded ranks (a head run apart rounds otherwise); and FSDP2 reshards the root's
        # parameters (the LM head's among them) when its forward ends: there the head must run inside it,
        # so a sharded model's logits come whole and the chunks only read them
        hidden, real = response_hidden(model, input_ids, attention_mask, position_ids, response_length, vision,
                                       logits=True)
        head = LMHead(torch.nn.Identity(), head.vocab_size)
    else:
        hidden, real = response_hidden(model, input_ids, attention_mask, position_ids, response_length, vision)
    rows, width = hidden.shape[:2]
    real_flat = None if real is None else real.reshape(-1, 1)

    def logits_of(h: torch.Tensor, at: slice) -> torch.Tensor:
        logits = head(h)
        if real_flat is not None:  # positions past a row's last token read 0 logits, whatever is beside them
            logits = logits.masked_fill(~real_flat[at], 0)
        logits = without_vision_tokens(model, logits.float())
        # greedy rollouts (T = 0) report T = 1 log-probs; dividing by 1 would copy every logit for nothing
        return logits if temperature <= 0 or temperature == 1.0 else logits / temperature

    stats = chunked_token_stats(hidden.reshape(rows * width, -1), input_ids[:, -response_length:].reshape(-1),
                                logits_of, head.vocab_size, **which)
    return tuple(None if t is None else t.view(rows, width) for t in stats)  # type: ignore[return-value]


def response_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    vision: VisionInputs | None = None,
    logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden[B, R, H], real[B, R] or None)``: the last hidden states (what the LM head reads) at the
    positions that predict the response tokens, and which of them are a row's real tokens (None: all
    are, as far as the model is concerned: a masked full-width pass).

    The model runs its own forward (its wrappers' hooks, e.g. FSDP's gathers, run as they should) with
    the LM head on one position only; its last hidden states are the head's input. With ``vision``, the
    model also reads the rows' pixels, and its positions come from its own rope index over the image
    grids (``[3, B, T]``) instead of ``position_ids``. ``logits=True``: the LM head's outputs
    ``[B, R, V]`` instead of its inputs.
    """
    extra = {}
    if vision is not None:
        position_ids = rope_positions(model, input_ids, attention_mask, vision.image_grid_thw)
        extra = vision.model_kwargs(model)
    packed = pack_rows(attention_mask, response_length)
    if packed is None:
        hidden = _last_states(model, response_length + 1, logits, input_ids=input_ids,
                              attention_mask=attention_mask, position_ids=position_ids, **extra)
        return hidden[:, -response_length - 1:-1], None
    # the LM head reads from the first column that predicts a response token in any row
    keep = packed.width - int(packed.read.min())
    hidden = _last_states(model, keep, logits, input_ids=packed.take(input_ids),
                          position_ids=packed.take(position_ids), **extra)
    return packed.read_out(hidden[:, -keep:], keep, fill=False), packed.real


def _last_states(model: torch.nn.Module, keep: int, logits: bool, **inputs: torch.Tensor) -> torch.Tensor:
    """The last hidden states of every position (the LM head run on one), or the logits of the last ``keep``."""
    if logits:
        return model(**inputs, logits_to_keep=keep).logits
    return model(**inputs, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]


@dataclass(frozen=True)
class LMHead:
    """The model's output layer as a function of its last hidden states: its linear map, then the logit
    scale or soft cap some architectures (Cohere, Gemma 2) apply after it."""

    linear: torch.nn.Module
    vocab_size: int
    scale: float | None = None
    softcap: float | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.scale is not None:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def lm_head(model: torch.nn.Module) -> LMHead:
    """:class:`LMHead` of a transformers causal LM (its ``get_output_embeddings()``)."""
    linear = model.get_output_embeddings()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return LMHead(linear, int(linear.weight.shape[0]), getattr(config, "logit_scale", None),
                  getattr(config, "final_logit_softcapping", None))


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """``values[B, R]``: the critic's value of the state before each response token."""
    packed = pack_rows(attention_mask, response_length)
    if packed is None:
        return critic(input_ids, attention_mask, position_ids)[:, -response_length - 1:-1]
    values = critic(packed.take(input_ids), None, packed.take(position_ids))
    return packed.read_out(values, packed.width)


@dataclass(frozen=True)
class PackedRows:
    """Rows shifted left to start at column 0 and cut to the longest: see :func:`pack_rows`."""

    #: ``[B, width]``: the source column of each packed column (past a row's end: its last column)
    source: torch.Tensor
    #: ``[B, R]``: the packed column whose output belongs to each response token
    read: torch.Tensor
    #: ``[B, R]``: whether that response token is one of the row's tokens (not padding)
    real: torch.Tensor
    width: int

    def take(self, columns: torch.Tensor) -> torch.Tensor:
        """``[..., B, T]`` per-column inputs (ids, positions; M-RoPE's ``[3, B, T]``) in packed order:
        ``[..., B, width]``."""
        return columns.gather(-1, self.source.expand(*columns.shape[:-2], *self.source.shape))

    def read_out(self, outputs: torch.Tensor, kept: int, fill: bool = True) -> torch.Tensor:
        """``[B, R, ...]`` from outputs of the last ``kept`` packed columns (``[B, kept, ...]``); 0 past
        each row's last token (``fill=False``: left as read, for a caller that masks what it derives)."""
        trailing = [1] * (outputs.dim() - 2)
        index = (self.read - (self.width - kept)).view(*self.read.shape, *trailing)
        picked = outputs.gather(1, index.expand(-1, -1, *outputs.shape[2:]))
        return picked.masked_fill(~self.real.view(*self.real.shape, *trailing), 0) if fill else picked


def pack_rows(attention_mask: torch.Tensor, response_length: int) -> PackedRows | None:
    """Each row's real tokens moved to start at column 0, cut to the longest row; ``None`` when some
    row's tokens are not one run (a mask with holes, e.g. tool output, needs the mask itself).

    Packed rows are right-padded only, so causal attention without a mask gives
    every real position what the masked full-width pass gives it.
    """
    mask = attention_mask.bool()
    rows, total = mask.shape
    if rows == 0 or response_length == 0:
        return None
    columns = torch.arange(total, device=mask.device)
    lengths = mask.sum(-1)
    lead = mask.int().argmax(-1)  # first real column (0 for an empty row)
    if not torch.equal(mask, (columns >= lead[:, None]) & (columns < (lead + lengths)[:, None])):
        return None
    width = max(int(lengths.max()), 1)
    source = (columns[:width] + lead[:, None]).clamp(max=total - 1)
    # response token j (column T - R + j) is predicted at column T - R - 1 + j, shifted by the row's lead
    read = columns[total - response_length - 1:total - 1] - lead[:, None]
    real = (read >= 0) & (read < (lengths - 1)[:, None])
    return PackedRows(source, read.clamp(0, width - 1), real, width)
