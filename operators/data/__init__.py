"""Prompts: builtin synthetic tasks and verl-format files, batched by one resumable loader.

Example::

    >>> from operators.models import load_tokenizer
    >>> from operators.data import load_dataset, PromptLoader
    >>> loader = PromptLoader(load_dataset("builtin:copy", load_tokenizer("builtin:tiny")), batch_size=32)
    >>> batch = loader.next_batch()      # input_ids, attention_mask, ..., ground_truth, data_source
"""

from operators.data.dataset import (
    REQUIRED_COLUMNS,
    DatasetError,
    PromptDataset,
    PromptLoader,
    left_pad,
    load_dataset,
    position_ids_from_mask,
    read_rows,
)
from operators.data.tasks import DEFAULT_TASK, TASKS, Task, TaskRows, get_task
from operators.data import skewed  # noqa: F401,E402  (registers builtin:skewed)

__all__ = [
    "REQUIRED_COLUMNS", "DatasetError", "PromptDataset", "PromptLoader", "left_pad", "load_dataset",
    "position_ids_from_mask", "read_rows",
    "DEFAULT_TASK", "TASKS", "Task", "TaskRows", "get_task",
]
