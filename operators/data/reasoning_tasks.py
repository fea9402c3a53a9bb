"""reasoning-gym's procedural tasks as prompts in verl's schema: the source ``reasoning_gym:<task>``.

Any of reasoning-gym's tasks (``chain_sum``, ``basic_arithmetic``, ``countdown``, ``letter_counting``...)
with its own options (``reasoning_gym.create_dataset(task, **config)``) becomes rows in verl's schema:

- ``prompt``: one user message, the task's question then the instruction of its answer format
  (:mod:`operators.data.answer_formats`, ``data.answer_format``): by default :data:`ANSWER_INSTRUCTION`,
  which asks for the final answer between ``<answer>`` and ``</answer>`` (reasoning-gym's own convention;
  the reward reads the last such span, so a model may think before it);
- ``data_source``: ``"reasoning_gym:<task>"``, which ``fn: auto`` scores with the task's own verifier
  (:mod:`operators.rewards.reasoning`);
- ``reward_model``: ``{"style": "rule", "ground_truth": <the task's answer>}``;
- ``extra_info``: ``index``, ``split``, and what the verifier needs besides the answer: the
  ``question``, the task's ``metadata`` and ``config``, ``format_score`` (what a parseable but
  wrong answer earns) and, for a format other than ``tags``, ``answer_format`` (which parser the reward
  reads the response with).

Rows are generated on demand from the seed (a task may take 100 ms a row). The held-out split never
repeats a training question: a question belongs to the held-out split when the digest of its text falls
in one of :data:`HELD_OUT_BUCKETS` buckets, so ``split="train"`` skips such questions and
``split="val"`` keeps only them (reasoning-gym seeds row ``i`` with ``seed + i``, so two seeds alone
would share most of their rows). Row ``i`` of the training split is the first candidate in the stream
keyed by ``(seed, split, i)`` that belongs to it. The held-out split is a score, so it never repeats
itself either: its row ``i`` is the ``i``-th distinct held-out question of the stream keyed by
``(seed, split)`` (a task with a narrow config, e.g. one-digit sums, holds out only a dozen questions;
asking for more rows than it has is an error that says how many there are).

Example::

    >>> rows = ReasoningGymRows("chain_sum", {"max_terms": 3}, seed=0, size=100)        # doctest: +SKIP
    >>> rows[0]["data_source"], rows[0]["reward_model"]["ground_truth"]                  # doctest: +SKIP
    ('reasoning_gym:chain_sum', '-4')
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import json
from functools import lru_cache
from typing import Any, Literal, Mapping, Sequence

from flowrl.errors import ConfigError
from operators.data.answer_formats import DEFAULT_FORMAT, answer_format as format_named, is_number

PREFIX = "reasoning_gym:"
ANSWER_INSTRUCTION = format_named(DEFAULT_FORMAT).instruction
#: one bucket of this many holds the held-out questions (a sixteenth of the task's questions)
HELD_OUT_BUCKETS = 16
#: candidates a row tries before its task is declared unable to fill the split (a held-out row
#: misses 255 times in a row with probability (15/16)^256 ≈ 7e-8)
MAX_ATTEMPTS = 256
#: candidates the held-out split reads past its last new question before it counts the task's held-out
#: questions as all found (a new one turns up every 16 candidates while there are many left)
MAX_DRY = MAX_ATTEMPTS * HELD_OUT_BUCKETS
#: options flowrl sets itself: the seed and the number of rows
OWN_OPTIONS = ("seed", "size")
INSTALL = 'pip install torch==2.13.0 -e ".[models]" (or pip install reasoning-gym==0.1.25)'

Split = Literal["train", "val"]


class ReasoningTaskError(ConfigError, ValueError):
    """A reasoning-gym task that cannot be made: an unknown name, a bad option, the package missing."""


def gym() -> Any:
    """The ``reasoning_gym`` package (imported on first use: it takes seconds)."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError:
        raise ReasoningTaskError(f"the source {PREFIX}<task> needs the reasoning-gym package; install it with "
                                 f"{INSTALL}") from None


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    gym()
    return sorted(importlib.import_module("reasoning_gym.factory").DATASETS)


def task_of(source: str) -> str:
    """``"chain_sum"`` of ``"reasoning_gym:chain_sum"``."""
    return source.removeprefix(PREFIX)


def check_task(task: str, config: Mapping[str, Any]) -> None:
    """Raise :class:`ReasoningTaskError` unless reasoning-gym knows ``task`` and takes ``config``: an
    unknown name lists the close ones, a bad option names it and reasoning-gym's reason."""
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=4, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ReasoningTaskError(f"unknown reasoning-gym task {task!r}; {hint}there are {len(names)}: "
                                 f"{', '.join(names[:12])}, ...")
    if own := [key for key in OWN_OPTIONS if key in config]:
        raise ReasoningTaskError(f"reasoning-gym task {task!r}: {own[0]!r} is flowrl's to set (trainer.seed, "
                                 f"data.task_size and data.val_size); leave it out of data.config")
    task_dataset(task, json.dumps(dict(config), sort_keys=True), 0, 1)


def check_answer_format(task: str, config: Mapping[str, Any], name: str, sample: int = 8) -> None:
    """Raise :class:`ReasoningTaskError` unless the answer format ``name`` exists and can read the task's
    answers: a numeric format needs the first ``sample`` answers to be numbers."""
    try:
        fmt = format_named(name)
    except ValueError as err:
        raise ReasoningTaskError(str(err)) from None
    if not fmt.numeric:
        return
    data = task_dataset(task, json.dumps(dict(config), sort_keys=True), 0, sample)
    wrong = next((str(entry["answer"]) for entry in data if not is_number(str(entry["answer"]))), None)
    if wrong is not None:
        raise ReasoningTaskError(f"answer_format {name!r} reads a number, but reasoning-gym task {task!r} answers "
                                 f"{wrong!r}; use answer_format: line (or tags) for it")


@lru_cache(maxsize=16)
def task_dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    config = json.loads(config_json)
    try:
        return gym().create_dataset(task, **config, seed=seed, size=size)
    except TypeError as err:  # an option the task's config class does not have
        fields = importlib.import_module("reasoning_gym.factory").DATASETS[task][1].__dataclass_fields__
        known = ", ".join(f for f in fields if f not in OWN_OPTIONS)
        raise ReasoningTaskError(f"reasoning-gym task {task!r}: {err}; its options are {known}") from None
    except (AssertionError, ValueError) as err:  # the config class's own validate()
        raise ReasoningTaskError(f"reasoning-gym task {task!r}: config {config} is refused: {err}") from None


def held_out(question: str) -> bool:
    """Whether ``question`` belongs to the held-out split: a pure function of its text."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % HELD_OUT_BUCKETS == 0


def _stream_seed(seed: int, split: Split) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{split}".encode()).digest()[:4], "big")


class ReasoningGymRows(Sequence[dict]):
    """``size`` rows of a reasoning-gym task in verl's schema (see the module doc), generated on demand;
    row ``i`` depends only on ``(task, config, seed, split, i)``."""

    def __init__(self, task: str, config: Mapping[str, Any] | None = None, *, seed: int = 0, size: int = 1000,
                 split: Split = "train", format_score: float = 0.0, answer_format: str = DEFAULT_FORMAT):
        if size <= 0:
            raise ValueError(f"task size must be positive, got {size}")
        self.task, self.config = task, dict(config or {})
        self.format = format_named(answer_format)
        check_task(task, self.config)
        self.size, self.split, self.format_score = size, split, format_score
        self._data = task_dataset(task, json.dumps(self.config, sort_keys=True), _stream_seed(seed, split), size)
        self._held: list[Mapping[str, Any]] = []  # the held-out split's rows found so far, in order
        self._held_questions: set[str] = set()  # their questions
        self._scanned = 0  # candidates of the stream read to find them

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if not -self.size <= i < self.size:
            raise IndexError(f"row {i} out of range for a task of {self.size} rows")
        return self._row(i % self.size)

    @lru_cache(maxsize=4096)  # a row is read to tokenize it and again to batch it
    def _row(self, i: int) -> dict[str, Any]:
        entry = self._entry(i)
        extra = {"index": i, "split": self.split, "question": entry["question"],
                 "metadata": entry.get("metadata", {}), "config": self.config, "format_score": self.format_score}
        if self.format.name != DEFAULT_FORMAT:  # the default's rows stay as they were: runs' digests unchanged
            extra["answer_format"] = self.format.name
        return {
            "prompt": [{"role": "user", "content": f"{entry['question']}\n\n{self.format.instruction}"}],
            "data_source": f"{PREFIX}{self.task}",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": extra,
        }

    def _entry(self, i: int) -> Mapping[str, Any]:
        if self.split == "val":
            return self._held_out_entry(i)
        for attempt in range(MAX_ATTEMPTS):
            try:
                entry = self._data[i + attempt * self.size]
            except IndexError:  # a task whose rows are a fixed list: no candidate past its size
                break
            if not held_out(entry["question"]):
                return entry
        raise ReasoningTaskError(
            f"reasoning-gym task {self.task!r} with config {self.config}: row {i} of the {self.split} split found "
            f"no question of its own in {MAX_ATTEMPTS} tries; the task's questions are too few to hold some "
            f"out (widen its config)")

    def _held_out_entry(self, i: int) -> Mapping[str, Any]:
        """Row ``i`` of the held-out split: the ``i``-th distinct held-out question of the stream."""
        dry = 0  # candidates since the last new question: a task out of questions stops here, not at the cap
        while len(self._held) <= i and self._scanned < MAX_ATTEMPTS * self.size and dry < MAX_DRY:
            try:
                entry = self._data[self._scanned]
            except IndexError:  # a task whose rows are a fixed list: no candidate past its size
                break
            self._scanned, dry = self._scanned + 1, dry + 1
            if held_out(entry["question"]) and entry["question"] not in self._held_questions:
                self._held_questions.add(entry["question"])
                self._held.append(entry)
                dry = 0
        if len(self._held) > i:
            return self._held[i]
        raise ReasoningTaskError(
            f"reasoning-gym task {self.task!r} with config {self.config}: the held-out split has "
            f"{len(self._held)} distinct questions in {self._scanned} candidates, fewer than data.val_size "
            f"{self.size}; lower data.val_size or widen the task's config")


def sample_rows(task: str, config: Mapping[str, Any], *, seed: int, size: int, split: Split,
                sample: int = 4) -> list[dict[str, Any]]:
    """The first ``sample`` rows: what ``flowrl validate`` reads to check the prompts against a tokenizer.
    For the held-out split it also finds the last row, so a task with fewer distinct held-out questions
    than ``size`` is refused before a run reaches its first validation."""
    rows = ReasoningGymRows(task, config, seed=seed, size=size, split=split)
    if split == "val":
        rows[size - 1]  # raises ReasoningTaskError when the split holds fewer questions
    return [rows[i] for i in range(min(sample, size))]
