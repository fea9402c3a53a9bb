"""Token ids of the turns that come from outside the model, and a check that they match a re-tokenisation.

Token in, token out: the ids the model sampled are kept exactly as sampled;
only the turns that come from outside (tool responses, user turns) are
rendered with the chat template (:class:`TurnRenderer`) and appended.
:func:`first_mismatch` compares the ids built this way with a re-tokenisation
of the whole conversation and reports the first differing position
(``strict``, ``ignore_strippable``: differences that decode to whitespace only
are ignored, or ``off``).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from operators.rollout.conversation import AgentLoopError

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TurnRenderer:
    """Token ids of turns appended to a conversation, rendered by the chat template alone.

    The ids of new messages are those the template adds when they follow a
    fixed base conversation, with the generation prompt for the next assistant
    turn: ``render(base + new, gen) - render(base)``. Nothing already in the
    conversation is re-tokenised.
    """

    BASE = [{"role": "user", "content": "0"}]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._base = self.encode(self.BASE, generation_prompt=False)

    def encode(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> list[int]:
        """The whole conversation through the chat template, as ids."""
        kwargs = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def new_turns(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of ``messages`` appended after an assistant turn, ending with the next generation prompt."""
        ids = self.encode(self.BASE + list(messages), generation_prompt=True)
        if ids[:len(self._base)] != self._base:
            raise AgentLoopError("the chat template renders earlier messages differently once more are "
                                 "appended, so new turns cannot be rendered alone; use a template whose "
                                 "rendering of a conversation is a prefix of the rendering of its continuation")
        return ids[len(self._base):]

    def assistant_text(self, ids: Sequence[int], stop_ids: set[int]) -> str:
        """The text of a sampled turn, its stop token left out (the template writes it)."""
        ids = list(ids)
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def response_as_whole(self, messages: Sequence[Mapping[str, Any]], ends_with_prompt: bool) -> list[int]:
        """The response part of the conversation re-tokenised in one piece: what :func:`first_mismatch` checks."""
        head = self.encode(self.BASE, generation_prompt=True)
        whole = self.encode(self.BASE + list(messages), generation_prompt=ends_with_prompt)
        return whole[len(head):] if whole[:len(head)] == head else whole


def first_mismatch(incremental: Sequence[int], retokenized: Sequence[int], mode: str,
                   tokenizer: PreTrainedTokenizerBase | None = None) -> int | None:
    """The first position where ``incremental`` and ``retokenized`` differ, or ``None``.

    ``strict``: any difference counts. ``ignore_strippable``: a differing span
    whose two sides both decode to whitespace only is ignored (needs
    ``tokenizer``). ``off``: always ``None``.

    Example::

        >>> first_mismatch([5, 6, 7, 8], [5, 6, 9, 8], "strict")
        2
        >>> first_mismatch([5, 6], [5, 6], "strict") is None
        True
    """
    if mode == "off":
        return None
    if mode not in ("strict", "ignore_strippable"):
        raise ValueError(f"tokenization_check must be 'strict', 'ignore_strippable' or 'off', got {mode!r}")
    incremental, retokenized = list(incremental), list(retokenized)
    if incremental == retokenized:
        return None
    matcher = difflib.SequenceMatcher(a=incremental, b=retokenized, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if mode == "ignore_strippable" and tokenizer is not None:
            left = tokenizer.decode(incremental[i1:i2], skip_special_tokens=False)
            right = tokenizer.decode(retokenized[j1:j2], skip_special_tokens=False)
            if not left.strip() and not right.strip():
                continue
        return i1
    return None
