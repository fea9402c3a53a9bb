"""Prompts: builtin synthetic tasks and verl-format files, batched by one resumable loader.

Example::

    >>> from operators.models import load_tokenizer
    >>> from operators.data import load_dataset, PromptLoader
    >>> loader = PromptLoader(load_dataset("builtin:copy", load_tokenizer("builtin:tiny")), batch_size=32)
    >>> batch = loader.next_batch()      # input_ids, attention_mask, ..., ground_truth, data_source
"""

from flowrl.data.lazy import lazy_exports

#: where each public name lives: imported on first use (the CLI loads operators without torch's weight)
_HOME = {
    "REQUIRED_COLUMNS": "operators.data.dataset",
    "DatasetError": "operators.data.dataset",
    "PromptDataset": "operators.data.dataset",
    "PromptLoader": "operators.data.dataset",
    "left_pad": "operators.data.dataset",
    "load_dataset": "operators.data.dataset",
    "position_ids_from_mask": "operators.data.dataset",
    "read_rows": "operators.data.dataset",
    "DEFAULT_TASK": "operators.data.tasks",
    "TASKS": "operators.data.tasks",
    "Task": "operators.data.tasks",
    "TaskRows": "operators.data.tasks",
    "get_task": "operators.data.tasks",
    "inspect_file": "operators.data.dataset",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = list(_HOME)  # every lazily exported name is public
