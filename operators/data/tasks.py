"""Builtin synthetic verifiable tasks, generated on the fly from a seed.

A task turns a random generator into ``(prompt, answer)`` text, one token per
digit: ``copy`` (the default: ``"copy 3 7 ="`` → ``"3 7"``), ``reverse``
(``"reverse 1 2 3 ="`` → ``"3 2 1"``) and ``add`` (``"add 8 5 ="`` → ``"1 3"``).
Row ``i`` of a task is a pure function of ``(seed, i)``, and rows come in verl's
schema, so a builtin task and a parquet file feed the same
:class:`~operators.data.dataset.PromptDataset`::

    >>> rows = TaskRows("copy", seed=0)
    >>> rows[0]["prompt"], rows[0]["reward_model"]["ground_truth"]
    ([{'role': 'user', 'content': 'copy 8 6 ='}], '8 6')
    >>> rows[0]["data_source"]
    'builtin:copy'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from operators.data.skewed import skewed_sample
from operators.data.tool_tasks import tool_add_extra_info, tool_add_sample


@dataclass(frozen=True)
class Task:
    """A named generator of ``(prompt, answer)`` pairs, both whitespace-separated tokens."""

    name: str
    description: str
    sample: Callable[[np.random.Generator], tuple[str, str]]
    #: more ``extra_info`` for a row from its ``(prompt, answer)`` (e.g. ``tools_kwargs``)
    extra_info: Callable[[str, str], dict] | None = None


def _spaced(digits: Sequence[int]) -> str:
    return " ".join(str(d) for d in digits)


def _copy(rng: np.random.Generator, n_digits: int = 2) -> tuple[str, str]:
    digits = rng.integers(0, 10, size=n_digits).tolist()
    return f"copy {_spaced(digits)} =", _spaced(digits)


def _reverse(rng: np.random.Generator, n_digits: int = 3) -> tuple[str, str]:
    digits = rng.integers(0, 10, size=n_digits).tolist()
    return f"reverse {_spaced(digits)} =", _spaced(digits[::-1])


def _add(rng: np.random.Generator, max_operand: int = 9) -> tuple[str, str]:
    a, b = rng.integers(0, max_operand + 1, size=2).tolist()
    return f"add {a} {b} =", _spaced(int(c) for c in str(a + b))


TASKS: dict[str, Task] = {
    "copy": Task("copy", "repeat 2 digits: 'copy 3 7 =' -> '3 7'", _copy),
    "reverse": Task("reverse", "reverse 3 digits: 'reverse 1 2 3 =' -> '3 2 1'", _reverse),
    "add": Task("add", "add two numbers 0-9, answer digit by digit: 'add 8 5 =' -> '1 3'", _add),
}
# DESIGN.md's examples say builtin:arith; it names the addition task.
TASKS["arith"] = Task("arith", TASKS["add"].description, _add)
TASKS["tool_add"] = Task("tool_add", "add two 2-digit numbers with the 'add' tool: '37+48=' -> '85' "
                         "(for builtin:tiny-tools)", tool_add_sample, tool_add_extra_info)
TASKS["skewed"] = Task("skewed", "repeat a digit d (d+1)^2 times, short answers common: 'copy 2 :' -> '2' x 9",
                       skewed_sample)

#: the task users get when they name none
DEFAULT_TASK = "copy"


def get_task(name: str) -> Task:
    """The task called ``name`` (``"copy"`` or ``"builtin:copy"``); a clear error otherwise."""
    key = name.removeprefix("builtin:")
    if key not in TASKS:
        raise ValueError(f"unknown builtin task {name!r}; available: "
                         + ", ".join(f"builtin:{k}" for k in TASKS))
    return TASKS[key]


class TaskRows(Sequence[dict]):
    """``size`` rows of a builtin task in verl's schema; row ``i`` depends only on ``(seed, i)``.

    Each row: ``prompt`` (one user message), ``data_source`` (``"builtin:<task>"``),
    ``reward_model`` (``{"style": "rule", "ground_truth": answer}``) and
    ``extra_info`` (``{"index": i}``).

    Example::

        >>> rows = TaskRows("add", size=10, seed=3)
        >>> len(rows), rows[4] == TaskRows("add", size=10, seed=3)[4]
        (10, True)
    """

    def __init__(self, task: str = DEFAULT_TASK, *, size: int = 100_000, seed: int = 0):
        if size <= 0:
            raise ValueError(f"task size must be positive, got {size}")
        self.task = get_task(task)
        self.size = size
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if not -self.size <= i < self.size:
            raise IndexError(f"row {i} out of range for a task of {self.size} rows")
        i = i % self.size
        prompt, answer = self.task.sample(np.random.default_rng((self.seed, i)))
        extra = self.task.extra_info(prompt, answer) if self.task.extra_info else {}
        return {
            "prompt": [{"role": "user", "content": prompt}],
            "data_source": f"builtin:{self.task.name}",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i, **extra},
        }
