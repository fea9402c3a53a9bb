"""Prompt sources: ``builtin:<task>`` (generated), parquet/jsonl files in verl's schema, and
reasoning-gym's tasks (``reasoning_gym:<task>``, generated, each with its own verifier).

Both yield, per step, ``batch_size`` prompts left-padded to one length, with
the columns below (the graph's *source fields*). ``uid`` names each prompt of
the step, so the ``n`` samples generated from it form one group.

Example YAML::

    data: {source: builtin:copy, batch_size: 32}
    data: {source: data/train.parquet, batch_size: 64, max_prompt_length: 512, truncation: left}
    data: {source: "reasoning_gym:chain_sum", batch_size: 8, config: {max_terms: 3}, format_score: 0.1}
    data: {source: "reasoning_gym:chain_sum", batch_size: 8, answer_format: number}
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tokenizers import Tokenizer

from flowrl.graph import source
from flowrl.graph.checks import DataSourceError, graph_check
from operators.data.dataset import (SAMPLE_ROWS, DatasetError, PromptDataset, PromptLoader, chat_messages,
                                    check_batch_size, inspect_file, load_dataset, unknown_words, vocabulary_problem)
from operators.data.multimodal import MULTIMODAL_FIELDS, is_multimodal, load_multimodal_dataset, load_processor
from operators.data.reasoning_tasks import PREFIX as GYM_PREFIX
from operators.data.answer_formats import DEFAULT_FORMAT, AnswerFormatName
from operators.data.reasoning_tasks import (ReasoningGymRows, ReasoningTaskError, check_answer_format, check_task,
                                            sample_rows, task_of)
from operators.data.shapes import ShapeRows, is_image_task
from operators.data.tasks import TaskRows
from operators.models.loading import (ModelLoadError, check_tokenizer_spec, has_chat_template, load_tokenizer,
                                      vocabulary)

# tensordict (under DataProto) is imported where a batch is built: ``flowrl validate`` checks
# a source's config and files without making one
if TYPE_CHECKING:
    from flowrl.data import DataProto

PROMPT_FIELDS = {
    "prompts": "int64[B, P]",
    "prompt_mask": "int64[B, P]",
    "data_source": "object[B]",
    "ground_truth": "object[B]",
    "extra_info": "object[B]",
    "reward_style": "object[B]",
    "agent_name": "object[B]",
    "uid": "object[B]",
    "tokenizer": "meta",
}


class PromptSourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    source: str
    batch_size: int = Field(16, ge=1)
    tokenizer: str | None = Field(None, description="default: the model of the first role that has one")
    max_prompt_length: int | None = Field(None, ge=1)
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    task_size: int = Field(100_000, ge=1, description="rows of a builtin task")
    val_source: str | None = Field(None, description="held-out prompts for validation")
    val_size: int = Field(128, ge=1, description="prompts per validation (a builtin task generates this many)")

    @field_validator("source", "val_source")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("builtin:") and not Path(v).is_file():
            raise ValueError(f"no such dataset file {v!r}: give a .parquet or .jsonl file in verl's schema, "
                             f"or builtin:<task>")
        return v


class ReasoningGymConfig(PromptSourceConfig):
    """``reasoning_gym:<task>``: the task's own options (``config``, given to reasoning-gym's
    ``create_dataset``), checked with the graph; rows generated from the run's seed."""

    config: dict[str, Any] = Field(default_factory=dict, description="the task's options: "
                                   "reasoning_gym.create_dataset(task, **config)")
    format_score: float = Field(0.0, ge=0.0, le=1.0, description="the reward of an answer the format's parser "
                                "reads that the task's verifier scores lower")
    answer_format: AnswerFormatName = Field(DEFAULT_FORMAT, description="how the prompt asks for the answer and "
                                            "the reward reads it: tags (<answer>...</answer>), number (the first "
                                            "number), line (the first line); operators.data.answer_formats")

    @field_validator("source", "val_source")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(GYM_PREFIX):
            raise ValueError(f"{v!r} is not a reasoning-gym task: write reasoning_gym:<task> (held-out prompts "
                             f"come from the same task: leave val_source out)")
        return v

    @model_validator(mode="after")
    def _known_task(self) -> "ReasoningGymConfig":
        if self.val_source is not None and self.val_source != self.source:
            raise ValueError(f"val_source {self.val_source!r} differs from source {self.source!r}: a reasoning-gym "
                             f"task holds out its own questions for validation; leave val_source out")
        try:
            check_task(task_of(self.source), self.config)
            check_answer_format(task_of(self.source), self.config, self.answer_format)
        except ReasoningTaskError as err:
            raise ValueError(str(err)) from None
        return self

    def rows(self, seed: int, split: Literal["train", "val"]) -> ReasoningGymRows:
        """The split's rows: ``task_size`` for training, ``val_size`` held out."""
        size = self.task_size if split == "train" else self.val_size
        return ReasoningGymRows(task_of(self.source), self.config, seed=seed, size=size, split=split,
                                format_score=self.format_score, answer_format=self.answer_format)


def source_config(data: dict[str, Any]) -> type[PromptSourceConfig]:
    """The config class of the source ``data`` names: a reasoning-gym task's, or the others'."""
    return ReasoningGymConfig if str(data.get("source", "")).startswith(GYM_PREFIX) else PromptSourceConfig


FILE_FIX = "convert the file to verl's schema (prompt, data_source, reward_model.ground_truth, extra_info)"


@lru_cache(maxsize=8)
def source_rows(spec: str, size: int) -> tuple[int, list[dict[str, Any]]]:
    """``(number of rows, the first rows)`` of ``builtin:<task>`` (``size`` rows) or a dataset file, checked
    as the run checks them and read as little as possible: what validate-time checks inspect."""
    if spec.startswith("builtin:"):
        rows = ShapeRows if is_image_task(spec) else TaskRows
        return size, list(rows(spec, size=min(size, SAMPLE_ROWS), seed=0))
    return inspect_file(spec)


@graph_check
def _data_source_fits(graph):
    """What the run's prompt loader would refuse, found from the files without tokenizing a batch: an
    unknown task, a file that does not fit verl's schema (sampled rows), fewer rows than a batch, a
    tokenizer without a chat template, words outside its vocabulary, prompts over max_prompt_length."""
    data = graph.config.data.dump()
    try:
        cfg = source_config(data).model_validate(data)
    except ValidationError:
        return  # the graph's build reports the data: settings
    spec, origin = tokenizer_origin(cfg, graph.config.roles)
    tok_at = graph.locate(*origin)
    try:
        check_tokenizer_spec(spec)
    except ModelLoadError as err:
        if cfg.tokenizer:  # a model's own tokenizer is reported with the model
            yield DataSourceError(str(err), location=tok_at, fix="set data.tokenizer to builtin:tiny or a "
                                  "local Hugging Face directory with a tokenizer")
        return
    if not has_chat_template(spec):
        yield DataSourceError(
            f"the tokenizer of {spec!r} has no chat template, and every prompt is formatted with it",
            location=tok_at, fix="save the tokenizer with one (tokenizer.chat_template = ...; "
                                 "tokenizer.save_pretrained(path)), or set data.tokenizer to one that has it")
    vocab = vocabulary(spec)
    gym = isinstance(cfg, ReasoningGymConfig)
    held_out = cfg.val_source or (cfg.source if gym else None)  # a reasoning-gym source holds its own out
    for key, source_spec in (("source", cfg.source), ("val_source", held_out)):
        if source_spec is None:
            continue
        # a held-out split too small for val_size is said at val_size
        where = graph.locate("data", key if key == "source" or cfg.val_source else "val_size")
        try:
            if gym:
                n_rows = cfg.task_size if key == "source" else cfg.val_size
                rows = sample_rows(task_of(source_spec), cfg.config, seed=0, size=n_rows,
                                   split="train" if key == "source" else "val")
            else:
                n_rows, rows = source_rows(source_spec, cfg.task_size if key == "source" else cfg.val_size)
        except (DatasetError, OSError, ValueError) as err:
            yield DataSourceError(str(err), location=where,
                                  fix="" if gym or source_spec.startswith("builtin:") else FILE_FIX)
            continue
        if key == "source":
            try:
                check_batch_size(source_spec, cfg.batch_size, n_rows)
            except DatasetError as err:
                yield DataSourceError(str(err), location=graph.locate("data", "batch_size"),
                                      fix="lower data.batch_size" + (", or raise data.task_size"
                                                                     if source_spec.startswith("builtin:") else ""))
        if vocab is not None and (problem := _prompts_problem(rows, vocab, cfg)):
            yield DataSourceError(f"{source_spec}: {problem}", location=where,
                                  fix="use prompts the tokenizer can read, or another tokenizer (data.tokenizer)")


def _prompts_problem(rows: list[dict[str, Any]], vocab: Tokenizer, cfg: PromptSourceConfig) -> str | None:
    """The first sampled row whose words the tokenizer does not know, or whose messages alone are longer
    than ``max_prompt_length`` when an overlong prompt is an error."""
    unk_token = getattr(vocab.model, "unk_token", None)
    unk_id = vocab.token_to_id(unk_token) if unk_token else None
    limit = cfg.max_prompt_length if cfg.truncation == "error" and not cfg.filter_overlong_prompts else None

    def encode(text: str) -> list[int]:
        return vocab.encode(text, add_special_tokens=False).ids

    for i, row in enumerate(rows):
        messages = chat_messages(row["prompt"])
        if unk_id is not None and (words := unknown_words(messages, encode, unk_id)):
            return f"row {i}: {vocabulary_problem(words, unk_token)}"
        if limit is not None and (n := sum(len(encode(str(m.get("content", "")))) for m in messages)) > limit:
            return (f"row {i}: a prompt of at least {n} tokens, over max_prompt_length={limit}; raise "
                    f"max_prompt_length, set truncation to 'left' or 'right', or filter_overlong_prompts")
    return None


class PromptSource:
    """Batches of prompts as DataProtos, with a resumable position."""

    def __init__(self, cfg: PromptSourceConfig, seed: int = 0, tokenizer: str = "builtin:tiny",
                 split: Literal["train", "val"] = "train") -> None:
        self.cfg, self.tokenizer_spec = cfg, tokenizer
        self.tokenizer = tok = load_tokenizer(tokenizer)
        spec = cfg.source if split == "train" else (cfg.val_source or cfg.source)
        # a builtin validation set is drawn from another seed: prompts the policy never trained on
        data_seed = seed if split == "train" else seed + 7919
        size = cfg.task_size if split == "train" else cfg.val_size
        limits = {"max_prompt_length": cfg.max_prompt_length, "truncation": cfg.truncation,
                  "filter_overlong_prompts": cfg.filter_overlong_prompts}
        # an image source is read with the model's processor: its image tokens count in every length
        processor = load_processor(tokenizer) if is_multimodal(spec) else None
        if is_multimodal(spec) and processor is None:
            raise DatasetError(f"{spec}: the prompts have images, but {tokenizer!r} has no processor; use a "
                               f"vision-language model (builtin:tiny-vl, or a directory AutoProcessor loads)")
        if isinstance(cfg, ReasoningGymConfig):  # its held-out split is its own, not another seed's
            self.dataset = PromptDataset(cfg.rows(seed, split), tok, name=spec, **limits)
        elif processor is not None:
            self.dataset = load_multimodal_dataset(spec, processor, seed=data_seed, task_size=size, **limits)
        else:
            self.dataset = load_dataset(spec, tok, seed=data_seed, task_size=size, **limits)
        # validation takes its whole held-out set (up to val_size prompts) as one batch
        batch = cfg.batch_size if split == "train" else min(cfg.val_size, len(self.dataset))
        self.loader = PromptLoader(self.dataset, batch, shuffle=cfg.shuffle and split == "train",
                                   seed=seed, drop_last=split == "train")
        self.step = 0
        self._generated = {"source": spec, "config": getattr(cfg, "config", {}), "task_size": size, "seed": data_seed}

    def identity(self) -> dict[str, Any]:
        """What the prompts come from, as a checkpoint records it (a resume refuses another): a file's
        path, size and the sha256 of the bytes read; a generated task's name, options, size and seed."""
        read = getattr(self.dataset.rows, "identity", None)
        return {"source": self._generated["source"], **read} if read is not None else dict(self._generated)

    def next_batch(self) -> DataProto:
        from flowrl.data import DataProto

        b = self.loader.next_batch()
        uid = np.array([f"{self.step}-{i}" for i in range(len(b["index"]))], dtype=object)
        self.step += 1
        return DataProto.from_dict(
            tensors={"prompts": b["input_ids"], "prompt_mask": b["attention_mask"]},
            non_tensors={"data_source": b["data_source"], "ground_truth": b["ground_truth"],
                         "extra_info": b["extra_info"], "reward_style": b["reward_style"],
                         "agent_name": b["agent_name"], "uid": uid,
                         **{k: b[k] for k in MULTIMODAL_FIELDS if k in b}},
            meta_info={"tokenizer": self.tokenizer_spec},
        )

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens dropped (for rollout dumps)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __iter__(self) -> "PromptSource":
        return self

    def __next__(self) -> DataProto:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])


def default_tokenizer(cfg: PromptSourceConfig, roles: dict[str, Any]) -> str:
    """The tokenizer a source uses: its own setting, else the first role's model."""
    return tokenizer_origin(cfg, roles)[0]


def tokenizer_origin(cfg: PromptSourceConfig, roles: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The tokenizer a source uses and the config key that names it (``data.tokenizer``, a role's model)."""
    if cfg.tokenizer:
        return cfg.tokenizer, ("data", "tokenizer")
    for name, role in roles.items():
        settings = role.settings if hasattr(role, "settings") else dict(role)
        if "model" in settings:
            return str(settings["model"]), ("roles", name, "model")
    return "builtin:tiny", ("data", "source")


def _fields(cfg: PromptSourceConfig) -> dict[str, str]:
    return {**PROMPT_FIELDS, **MULTIMODAL_FIELDS} if is_multimodal(cfg.source) else PROMPT_FIELDS


@source("builtin", config=PromptSourceConfig, fields=_fields)
def builtin_source(cfg: PromptSourceConfig, seed: int = 0, roles: dict[str, Any] | None = None,
                   split: Literal["train", "val"] = "train") -> PromptSource:
    """A synthetic verifiable task generated from the seed (``builtin:copy``, ``builtin:add``...)."""
    return PromptSource(cfg, seed, default_tokenizer(cfg, roles or {}), split)


@source("file", config=PromptSourceConfig, fields=_fields)
def file_source(cfg: PromptSourceConfig, seed: int = 0, roles: dict[str, Any] | None = None,
                split: Literal["train", "val"] = "train") -> PromptSource:
    """A parquet or jsonl file in verl's schema (prompt, data_source, reward_model.ground_truth, extra_info)."""
    return PromptSource(cfg, seed, default_tokenizer(cfg, roles or {}), split)


@source("reasoning_gym", config=ReasoningGymConfig, fields=_fields)
def reasoning_gym_source(cfg: ReasoningGymConfig, seed: int = 0, roles: dict[str, Any] | None = None,
                         split: Literal["train", "val"] = "train") -> PromptSource:
    """A reasoning-gym task (``reasoning_gym:chain_sum``...) with its options (``config``), generated from the
    seed, prompts through the model's chat template asking for the answer in ``answer_format``; its rows' verifier
    scores them (``fn: auto``); validation takes held-out questions no training step sees."""
    return PromptSource(cfg, seed, default_tokenizer(cfg, roles or {}), split)
