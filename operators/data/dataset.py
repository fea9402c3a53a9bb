"""Prompt datasets in verl's schema, and a shuffling loader whose position can be saved.

A row has ``prompt`` (a list of chat messages, or a plain string), ``data_source``,
``reward_model`` (a dict with ``ground_truth``) and optionally ``extra_info``
(a dict, may hold ``tools_kwargs``). :class:`PromptDataset` applies the
tokenizer's chat template and the prompt-length policy; :class:`PromptLoader`
cuts it into batches, reshuffling every epoch from ``(seed, epoch)``, so a
saved ``{"epoch", "index"}`` reproduces the exact batches that follow.

A batch (from :meth:`PromptDataset.collate`) is a plain dict:

=================  ==========================  ====================================
``input_ids``      ``int64[B, P]``              left-padded prompt token ids
``attention_mask`` ``int64[B, P]``              1 on prompt tokens
``position_ids``   ``int64[B, P]``              ``clip(cumsum(mask) - 1, 0)``
``raw_prompt_ids`` ``object[B]``                each prompt's ids, unpadded (lists)
``data_source``    ``object[B]``                e.g. ``"builtin:copy"``, ``"openai/gsm8k"``
``ground_truth``   ``object[B]``                ``reward_model["ground_truth"]``
``extra_info``     ``object[B]``                dicts
``reward_style``   ``object[B]``                ``reward_model.get("style", "rule")``
``tools_kwargs``   ``object[B]``                ``extra_info.get("tools_kwargs", {})``
``interaction_kwargs`` ``object[B]``            ``extra_info.get("interaction_kwargs", {})``
``agent_name``     ``object[B]``                the row's ``agent_name`` (its agent loop), or ``None``
``index``          ``int64[B]`` (numpy)         the row's position in the dataset
=================  ==========================  ====================================

Example::

    >>> from operators.models import load_tokenizer
    >>> tok = load_tokenizer("builtin:tiny")
    >>> loader = PromptLoader(load_dataset("builtin:copy", tok), batch_size=4, seed=0)
    >>> batch = loader.next_batch()
    >>> batch["input_ids"].shape, batch["ground_truth"][0]
    (torch.Size([4, 5]), '4 5')
    >>> loader.state_dict()
    {'epoch': 0, 'index': 4}
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from flowrl.errors import ConfigError
from operators.data.tasks import TaskRows

# type hints only: declaring operators (``flowrl validate``) does not import transformers
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Truncation = Literal["left", "right", "error"]
REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")


class DatasetError(ConfigError, ValueError):
    """A dataset file or row does not fit the verl schema: names the file, row and column."""


def check_columns(path: Path, columns: list[str], n_rows: int) -> None:
    """Raise :class:`DatasetError` unless the file has rows and every column of :data:`REQUIRED_COLUMNS`."""
    if n_rows == 0:
        raise DatasetError(f"{path}: the file has no rows; give a dataset with at least batch_size rows")
    for column in REQUIRED_COLUMNS:
        if column not in columns:
            raise DatasetError(
                f"{path}: missing required column {column!r} (found: {', '.join(columns) or 'none'}); "
                f"verl-format rows need {', '.join(REQUIRED_COLUMNS)} and optionally extra_info"
            )


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with a ``prompt`` value (a string, or chat messages with role and content), or None."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist") and not isinstance(prompt, (int, float))):
        messages = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if messages and all(isinstance(m, Mapping) and "content" in m and "role" in m for m in messages):
            return None
    return (f"'prompt' is {type(prompt).__name__} {str(prompt)[:60]!r}; give a string or a list of chat "
            f"messages like [{{'role': 'user', 'content': '...'}}]")


#: rows of a file ``flowrl validate`` reads and checks (a jsonl file is read whole: its rows are all checked)
SAMPLE_ROWS = 256


def row_problem(row: Mapping[str, Any]) -> str | None:
    """What is wrong with one row in verl's schema, or None: the one rule the run and ``flowrl validate`` share."""
    if missing := [c for c in REQUIRED_COLUMNS if row.get(c) is None]:
        return f"no value for column {missing[0]!r}"
    if problem := prompt_problem(row["prompt"]):
        return problem
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        return "column 'reward_model' needs a 'ground_truth' key"
    style = reward_model.get("style") or "rule"
    if style not in ("rule", "model"):
        return f"reward_model.style is {style!r}; use 'rule' or 'model'"
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        return f"'extra_info' is {type(extra).__name__} {str(extra)[:60]!r}; give a dict (or leave it out)"
    return None


def _check_schema(path: Path, schema: Any) -> None:
    """A parquet column whose type no row could fit, named before any row is read."""
    import pyarrow as pa

    def is_text(t: Any) -> bool:
        return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)

    def is_record(t: Any) -> bool:
        return pa.types.is_struct(t) or pa.types.is_map(t) or pa.types.is_null(t)

    expect = {
        "prompt": ("a string or a list of chat messages (struct of role, content)",
                   lambda t: is_text(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t))
                                            and (pa.types.is_struct(t.value_type) or pa.types.is_null(t.value_type)))),
        "data_source": ("a string", is_text),
        "reward_model": ("a struct with ground_truth", lambda t: is_record(t) and not (
            pa.types.is_struct(t) and t.get_field_index("ground_truth") < 0)),
        "extra_info": ("a struct (a dict per row)", is_record),
    }
    for column, (what, fits) in expect.items():
        if column in schema.names and not fits(schema.field(column).type):
            raise DatasetError(f"{path}: column {column!r} has type {schema.field(column).type}; verl's schema "
                               f"needs {what}")


def chat_messages(prompt: Any) -> list[Mapping[str, Any]]:
    """A checked ``prompt`` as chat messages: a string is one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def check_batch_size(name: str, batch_size: int, n_rows: int) -> None:
    """Raise :class:`DatasetError` when a dataset of ``n_rows`` cannot fill one batch of ``batch_size``."""
    if batch_size > n_rows:
        raise DatasetError(f"{name}: batch_size={batch_size} exceeds its {n_rows} rows")


def unknown_words(messages: Sequence[Mapping[str, Any]], encode: Callable[[str], list[int]], unk_id: int) -> list[str]:
    """The words of ``messages`` that ``encode`` reads as the unknown token ``unk_id``, sorted."""
    return sorted({w for m in messages for w in str(m.get("content", "")).split() if unk_id in encode(w)})


def vocabulary_problem(words: Sequence[str], unk_token: str) -> str:
    """What the run says of a prompt with words outside a closed vocabulary."""
    return (f"the prompt has words outside the tokenizer's vocabulary "
            f"({', '.join(repr(w) for w in words[:8]) or 'some characters'}), which would be read as "
            f"{unk_token}; use a tokenizer that knows them (a real model's), or prompts in its vocabulary")


def inspect_file(path: str | Path, sample: int = SAMPLE_ROWS) -> tuple[int, list[dict[str, Any]]]:
    """``(number of rows, the first rows)`` of a dataset file, checked as the run checks them, reading as
    little as it can: a parquet file's schema and its first ``sample`` rows; a jsonl file is read whole
    (every row checked) — what ``flowrl validate`` runs."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path)
            check_columns(path, list(meta.schema_arrow.names), meta.metadata.num_rows)
            _check_schema(path, meta.schema_arrow)
            rows = next(meta.iter_batches(batch_size=sample)).to_pylist()
        except DatasetError:
            raise
        except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a file it cannot read
            raise DatasetError(f"{path}: not a readable parquet file ({err})") from None
        for i, row in enumerate(rows):
            if problem := row_problem(row):
                raise DatasetError(f"{path}: row {i}: {problem}")
        return meta.metadata.num_rows, rows
    rows = read_rows(path)
    return len(rows), rows[:sample]


def data_sources(path: str | Path) -> dict[str, int]:
    """Each distinct ``data_source`` of a dataset file, with the first row that has it (a parquet file's
    one column is read, not its rows): what a reward chosen by ``data_source`` will be asked to score."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        values = pq.read_table(path, columns=["data_source"]).column(0).to_pylist()
    else:
        values = [row.get("data_source") for row in read_rows(path)]
    first: dict[str, int] = {}
    for i, value in enumerate(values):
        first.setdefault(str(value), i)
    return first


def _json_row(path: Path, line_no: int, raw: bytes) -> dict[str, Any]:
    """One line of a jsonl file as a row, or a :class:`DatasetError` naming the line and what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: line {line_no} is not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                           f"{err.start + 1}); save the file as UTF-8") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: line {line_no} is not valid JSON: {err}") from None
    except (ValueError, RecursionError) as err:  # nested too deep, or an integer past Python's digit limit
        raise DatasetError(f"{path}: line {line_no} cannot be read as JSON ({type(err).__name__})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: line {line_no} is a JSON {type(row).__name__}, not an object of columns")
    return row


class FileRows(list):
    """A file's rows, with the identity of the bytes they were read from (``identity``: ``path``,
    ``size``, ``sha256``): what a checkpoint records so a resume notices a changed file."""

    identity: dict[str, Any]


def read_rows(path: str | Path) -> FileRows:
    """Rows of a ``.parquet`` or ``.jsonl`` file as dicts, after checking the required columns; their
    ``identity`` is the digest of the very bytes parsed (the file is read once).

    A missing file raises ``FileNotFoundError`` naming it
    (``read_rows("missing.parquet")`` → ``dataset file 'missing.parquet' does not exist``);
    a missing required column raises :class:`DatasetError` naming the file and the column.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file '{path}' does not exist (resolved: {path.resolve()})")
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .parquet or .jsonl")
    data = path.read_bytes()
    rows = FileRows()
    rows.identity = {"path": str(path.resolve()), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(data))
        columns = table.column_names
        rows.extend(table.to_pylist())
    else:
        for line_no, raw in enumerate(io.BytesIO(data), start=1):
            if raw.strip():
                rows.append(_json_row(path, line_no, raw))
        columns = sorted({key for row in rows for key in row})
    check_columns(path, columns, len(rows))
    if suffix == ".parquet":
        _check_schema(path, table.schema)
    for i, row in enumerate(rows):
        if problem := row_problem(row):
            raise DatasetError(f"{path}: row {i}: {problem}")
    return rows


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``clip(cumsum(mask) - 1, min=0)``: positions count only real tokens (left padding → 0).

    Example::

        >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]]))
        tensor([[0, 0, 0, 1, 2]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``length`` (default: the longest); return ``(ids, mask)``.

    Example::

        >>> left_pad([[5, 6], [7]], pad_id=0)
        (tensor([[5, 6],
                [0, 7]]), tensor([[1, 1],
                [0, 1]]))
    """
    length = max((len(s) for s in sequences), default=0) if length is None else length
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, length - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[i, length - len(seq):] = 1
    return ids, mask


class PromptDataset:
    """Rows in verl's schema, tokenized with the chat template, under a prompt-length policy.

    ``max_prompt_length``: ``None`` pads each batch to its longest prompt; an int
    pads every batch to exactly that width, and a longer prompt is dropped
    (``filter_overlong_prompts=True``, decided once at construction) or cut
    (``truncation="left"`` keeps its end, ``"right"`` its start) or is an error
    (``"error"``, naming the row).
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_length: int | None = None,
        truncation: Truncation = "error",
        filter_overlong_prompts: bool = False,
        name: str = "<rows>",
    ):
        if truncation not in ("left", "right", "error"):
            raise ValueError(f"truncation must be 'left', 'right' or 'error', got {truncation!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DatasetError(
                f"{name}: the tokenizer has no chat template, so chat-message prompts cannot be "
                "formatted; use a tokenizer saved with one (tokenizer.chat_template = ...)"
            )
        self.rows = rows
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.name = name
        self._cache: dict[str, list[int]] = {}
        self.row_ids: Sequence[int] = range(len(rows))
        if filter_overlong_prompts and max_prompt_length is not None:
            self.row_ids = [i for i in range(len(rows))
                            if len(self._encode(rows[i]["prompt"], i)) <= max_prompt_length]

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> "PromptDataset":
        """Read a ``.parquet``/``.jsonl`` file in verl's schema (see :func:`read_rows`).

        With ``truncation="error"``, every prompt's length is checked here, so an
        overlong row fails at load time rather than mid-run.
        """
        dataset = cls(read_rows(path), tokenizer, name=str(path), **kwargs)
        if dataset.max_prompt_length is not None and dataset.truncation == "error":
            for i in range(len(dataset)):
                dataset.prompt_ids(i)
        return dataset

    def __len__(self) -> int:
        return len(self.row_ids)

    def _encode(self, prompt: Any, row_id: int | None = None) -> list[int]:
        where = f"{self.name}: row {row_id}" if row_id is not None else self.name
        problem = prompt_problem(prompt)
        if problem:
            raise DatasetError(f"{where}: {problem}")
        messages = chat_messages(prompt)
        key = json.dumps(messages, sort_keys=True, default=str)
        if key not in self._cache:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            unk = self.tokenizer.unk_token_id
            if unk is not None and unk in ids:
                # a closed vocabulary (builtin:tiny's) would silently read the word as <unk>
                words = unknown_words(messages, lambda w: self.tokenizer.encode(w, add_special_tokens=False), unk)
                raise DatasetError(f"{where}: {vocabulary_problem(words, self.tokenizer.unk_token)}")
            self._cache[key] = ids
        return self._cache[key]

    def prompt_ids(self, i: int) -> list[int]:
        """Token ids of row ``i`` (``i`` indexes the kept rows), after truncation."""
        row_id = self.row_ids[i]
        ids = self._encode(self.rows[row_id]["prompt"], row_id)
        limit = self.max_prompt_length
        if limit is None or len(ids) <= limit:
            return ids
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        raise DatasetError(
            f"{self.name}: row {row_id} has a {len(ids)}-token prompt, over max_prompt_length={limit}; "
            "raise max_prompt_length, set truncation to 'left' or 'right', or filter_overlong_prompts"
        )

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        """The batch of rows ``indices`` (positions among the kept rows), as documented above."""
        prompts = [self.prompt_ids(i) for i in indices]
        rows = [self.rows[self.row_ids[i]] for i in indices]
        for row, i in zip(rows, indices):  # rows given directly (not read from a file) are checked here
            if problem := row_problem(row):
                raise DatasetError(f"{self.name}: row {self.row_ids[i]}: {problem}")
        input_ids, attention_mask = left_pad(prompts, self.tokenizer.pad_token_id, self.max_prompt_length)
        extra = [dict(row.get("extra_info") or {}) for row in rows]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "raw_prompt_ids": object_array(prompts),
            "data_source": object_array([row["data_source"] for row in rows]),
            "ground_truth": object_array([row["reward_model"]["ground_truth"] for row in rows]),
            "extra_info": object_array(extra),
            "reward_style": object_array([row["reward_model"].get("style") or "rule" for row in rows]),
            "tools_kwargs": object_array([e.get("tools_kwargs") or {} for e in extra]),
            "interaction_kwargs": object_array([e.get("interaction_kwargs") or {} for e in extra]),
            "agent_name": object_array([row.get("agent_name") for row in rows]),
            "index": np.asarray([self.row_ids[i] for i in indices], dtype=np.int64),
        }


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D numpy object array of ``values``, lists kept as items (``np.array`` would stack them)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # item by item: equal-length lists must stay lists
        out[i] = value
    return out


def load_dataset(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    task_size: int = 100_000,
    **kwargs: Any,
) -> PromptDataset:
    """``builtin:<task>`` (generated from ``seed``, ``task_size`` rows) or a parquet/jsonl path.

    ``kwargs`` go to :class:`PromptDataset` (``max_prompt_length``, ``truncation``,
    ``filter_overlong_prompts``).

    Example::

        >>> ds = load_dataset("builtin:reverse", tok, seed=1, task_size=8)   # doctest: +SKIP
        >>> len(ds)                                                           # doctest: +SKIP
        8
    """
    if source.startswith("builtin:"):
        return PromptDataset(TaskRows(source, size=task_size, seed=seed), tokenizer, name=source, **kwargs)
    return PromptDataset.from_file(source, tokenizer, **kwargs)


class PromptLoader:
    """Batches of a :class:`PromptDataset`, reshuffled every epoch, resumable exactly.

    The order of epoch ``e`` is a permutation drawn from ``(seed, e)``; the
    position is ``(epoch, index)`` with ``index`` rows of that order consumed.
    With ``drop_last`` a short tail starts the next epoch instead.

    Example::

        >>> a = PromptLoader(ds, batch_size=2, seed=0)                    # doctest: +SKIP
        >>> _ = a.next_batch(); state = a.state_dict()                    # doctest: +SKIP
        >>> b = PromptLoader(ds, batch_size=2, seed=0); b.load_state_dict(state)  # doctest: +SKIP
        >>> (a.next_batch()["index"] == b.next_batch()["index"]).all()   # doctest: +SKIP
        True
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) == 0:
            raise DatasetError(f"{dataset.name}: no rows left (after filtering overlong prompts)")
        if drop_last:
            check_batch_size(dataset.name, batch_size, len(dataset))
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng((self.seed, self.epoch)).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = self.epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        """Dataset positions of the next batch, advancing the position."""
        order = self._epoch_order()
        left = len(order) - self.index
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch, self.index = self.epoch + 1, 0
            order = self._epoch_order()
        chosen = order[self.index:self.index + self.batch_size]
        self.index += len(chosen)
        return chosen

    def next_batch(self) -> dict[str, Any]:
        """The next batch (see the module docstring for its columns)."""
        return self.dataset.collate(self.next_indices().tolist())

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "index"}``: enough, with the same dataset and seed, to resume exactly."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
