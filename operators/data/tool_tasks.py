"""``builtin:tool_add``: a task where calling a tool pays, for ``builtin:tiny-tools``.

The prompt asks for the sum of two 2-digit numbers (``"37+48="`` → ``"85"``),
which the 0.5M-parameter model cannot learn to compute in a few CPU minutes; the
``add`` calculator tool (:func:`operators.rollout.tools.add`) can. A solved
conversation::

    user       37+48=
    assistant  <tool_call>{"name": "add", "arguments": {"a": 37, "b": 48}}</tool_call>
    tool       85
    assistant  85

Each row carries, in verl's layout, ``extra_info.tools_kwargs`` for the ``add``
tool (the prompt's operands, so the tool can pay a small reward for a call with
the right numbers)::

    >>> from operators.data.tasks import TaskRows
    >>> row = TaskRows("tool_add", size=4, seed=0)[0]
    >>> row["prompt"], row["reward_model"]["ground_truth"]
    ([{'role': 'user', 'content': '86+67='}], '153')
    >>> row["extra_info"]["tools_kwargs"]
    {'add': {'create_kwargs': {'a': 86, 'b': 67}}}

:func:`warmup_batch` makes the supervised warm-up data of ``builtin:tiny-tools``:
conversations in the solved layout whose calls carry the prompt's numbers 60%
of the time (random numbers otherwise), the answer always copying the tool's
result. The warm-up teaches the call format and, noisily, which numbers to
send: sampled at temperature 1 the warmed-up model sends the right numbers in
about one call of five; reinforcement learning makes that reliable.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: the share of warm-up calls that carry the prompt's own numbers
WARMUP_CORRECT_SHARE = 0.6

_PROMPT = re.compile(r"^(\d+)\+(\d+)=$")


def tool_add_sample(rng: np.random.Generator) -> tuple[str, str]:
    """``("37+48=", "85")``: two numbers in 10..99 and their sum."""
    a, b = rng.integers(10, 100, size=2).tolist()
    return f"{a}+{b}=", str(a + b)


def tool_add_extra_info(prompt: str, answer: str) -> dict[str, Any]:
    """``tools_kwargs`` of a ``tool_add`` row: the operands, for the tool's reward."""
    a, b = (int(x) for x in _PROMPT.match(prompt).groups())
    return {"tools_kwargs": {"add": {"create_kwargs": {"a": a, "b": b}}}}


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes/Qwen tool call: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Example::

        >>> tool_call_text("add", {"a": 1, "b": 2})
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    """
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def solved_conversation(prompt: str, a: int, b: int) -> list[dict[str, str]]:
    """The conversation that calls ``add(a, b)`` and answers with its result."""
    result = str(a + b)
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": tool_call_text("add", {"a": a, "b": b})},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def conversation_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
                     ) -> tuple[list[int], list[int]]:
    """``(ids, assistant_mask)`` of a whole conversation: the mask is 1 on assistant turns' own tokens.

    Each boundary is found by rendering the conversation up to that message, so
    it needs a tokenizer that tokenises a prefix as it tokenises the whole (true
    of ``builtin:tiny-tools``).
    """
    def render(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation_prompt,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    ids = render(len(messages), False)
    mask = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = len(render(k, True)), len(render(k + 1, False))
            mask[start:end] = [1] * (end - start)
    return ids, mask


def warmup_batch(tokenizer: PreTrainedTokenizerBase, batch_size: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, loss_mask)``, right-padded: one warm-up batch drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch_size):
        prompt, _ = tool_add_sample(rng)
        a, b = (int(x) for x in _PROMPT.match(prompt).groups())
        if rng.random() >= WARMUP_CORRECT_SHARE:
            a, b = rng.integers(10, 100, size=2).tolist()
        rows.append(conversation_ids(tokenizer, solved_conversation(prompt, a, b)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch_size, width), dtype=torch.long)
    loss_mask = torch.zeros((batch_size, width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
        loss_mask[i, :len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return input_ids, attention, loss_mask
