"""Prompt sources: ``builtin:<task>`` (generated) and parquet/jsonl files in verl's schema.

Both yield, per step, ``batch_size`` prompts left-padded to one length, with
the columns below (the graph's *source fields*). ``uid`` names each prompt of
the step, so the ``n`` samples generated from it form one group.

Example YAML::

    data: {source: builtin:copy, batch_size: 32}
    data: {source: data/train.parquet, batch_size: 64, max_prompt_length: 512, truncation: left}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowrl.graph import source
from flowrl.graph.checks import DataSourceError, graph_check
from operators.data import DatasetError, PromptLoader, inspect_file, load_dataset
from operators.models import load_tokenizer

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
    model_config = ConfigDict(extra="forbid")
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


@graph_check
def _dataset_files_open(graph):
    """A dataset file that does not open, has no rows or lacks a column fails at validate time."""
    data = graph.config.data
    for key, spec in (("source", data.source), ("val_source", data.settings.get("val_source"))):
        if isinstance(spec, str) and not spec.startswith("builtin:") and Path(spec).is_file():
            try:
                inspect_file(spec)
            except (DatasetError, OSError) as err:
                yield DataSourceError(str(err), location=graph.locate("data", key),
                                      fix="convert the file to verl's schema (prompt, data_source, "
                                          "reward_model.ground_truth, extra_info)")


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
        self.dataset = load_dataset(spec, tok, seed=data_seed, task_size=size,
                                    max_prompt_length=cfg.max_prompt_length, truncation=cfg.truncation,
                                    filter_overlong_prompts=cfg.filter_overlong_prompts)
        # validation takes its whole held-out set (up to val_size prompts) as one batch
        batch = cfg.batch_size if split == "train" else min(cfg.val_size, len(self.dataset))
        self.loader = PromptLoader(self.dataset, batch, shuffle=cfg.shuffle and split == "train",
                                   seed=seed, drop_last=split == "train")
        self.step = 0

    def next_batch(self) -> DataProto:
        from flowrl.data import DataProto

        b = self.loader.next_batch()
        uid = np.array([f"{self.step}-{i}" for i in range(len(b["index"]))], dtype=object)
        self.step += 1
        return DataProto.from_dict(
            tensors={"prompts": b["input_ids"], "prompt_mask": b["attention_mask"]},
            non_tensors={"data_source": b["data_source"], "ground_truth": b["ground_truth"],
                         "extra_info": b["extra_info"], "reward_style": b["reward_style"],
                         "agent_name": b["agent_name"], "uid": uid},
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
    if cfg.tokenizer:
        return cfg.tokenizer
    for role in roles.values():
        settings = role.settings if hasattr(role, "settings") else dict(role)
        if "model" in settings:
            return str(settings["model"])
    return "builtin:tiny"


def _fields(cfg: PromptSourceConfig) -> dict[str, str]:
    return PROMPT_FIELDS


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
