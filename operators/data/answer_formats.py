"""How a prompt asks for its answer and how a response's answer is read back: ``data.answer_format``.

One :class:`AnswerFormat` is the instruction appended to a reasoning-gym question and the parser the
reward (:mod:`operators.rewards.reasoning`) reads the response with; the task's own ``score_answer``
then judges what the parser found. Formats:

==========  ====================================================  ==================================
name        instruction                                           answer read
==========  ====================================================  ==================================
``tags``    ``Give only your final answer between <answer> and    the last ``<answer>...</answer>``
            </answer> tags.`` (reasoning-gym's convention)         span (any task; a model may think
                                                                  before it)
``number``  ``Answer with the number only.``                      the last number of the response
                                                                  (tasks whose answers are numbers)
``line``    ``Reply with the final answer only.``                 the first non-empty line, a closing
                                                                  period dropped (any task)
==========  ====================================================  ==================================

A small instruct model may never write the tags (SmolLM2-135M-Instruct, greedy, does not): ``number``
reads the answer it does write, which comes last ("7 + 5 = 12", "The answer is 12.", never the
question's own numbers first), and ``line`` is the same idea for any task.

Example::

    >>> ANSWER_FORMATS["number"].parse("7 + 5 = -1,204.")
    '-1204'
    >>> ANSWER_FORMATS["tags"].parse("so <answer> 4 </answer>"), ANSWER_FORMATS["line"].parse("\\n blue.\\nok")
    ('4', 'blue')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal

AnswerFormatName = Literal["tags", "number", "line"]

_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# a sign, digits with optional thousands commas, an optional decimal part
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_tag_span(response: str) -> str | None:
    spans = _TAGS.findall(response)
    return spans[-1].strip() if spans else None


def _last_number(response: str) -> str | None:
    found = _NUMBER.findall(response)
    # thousands separators are the model's style, not part of the number the verifier compares
    return found[-1].replace(",", "") if found else None


def _first_line(response: str) -> str | None:
    line = next((line.strip() for line in response.splitlines() if line.strip()), "")
    return line.removesuffix(".").strip() or None


@dataclass(frozen=True)
class AnswerFormat:
    """An answer format: the ``instruction`` a prompt ends with, and ``parse``, the answer a response
    gives (None when it gives none: the reward's ``formatted`` is 0)."""

    name: str
    instruction: str
    parse: Callable[[str], str | None]
    numeric: bool = False  # only for tasks whose answers are numbers


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "tags": AnswerFormat("tags", "Give only your final answer between <answer> and </answer> tags.",
                         _last_tag_span),
    "number": AnswerFormat("number", "Answer with the number only.", _last_number, numeric=True),
    "line": AnswerFormat("line", "Reply with the final answer only.", _first_line),
}
DEFAULT_FORMAT = "tags"


def answer_format(name: str) -> AnswerFormat:
    """The format ``name``, or a ``ValueError`` that lists the formats there are."""
    if name not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {name!r}: use one of {', '.join(ANSWER_FORMATS)}")
    return ANSWER_FORMATS[name]


def is_number(text: str) -> bool:
    """Whether ``text`` is one number as :data:`ANSWER_FORMATS`'s ``number`` reads it."""
    return _NUMBER.fullmatch(text.strip()) is not None
