"""Image prompts in verl's layout: the ``images`` column, ``<image>`` placeholders, the model's processor.

A row is a verl row (``prompt``, ``data_source``, ``reward_model``,
``extra_info``) plus ``images``: a list of pictures, each a PIL image, a path,
or a dict as Hugging Face datasets store images in parquet
(``{"bytes": ..., "path": ...}``; ``{"image": ...}`` too). Each ``<image>`` in
a message's content is replaced, in order, by the next picture, as verl's
``RLHFDataset`` does: the content becomes ``[{"type": "image"}, {"type":
"text", "text": ...}]`` for the processor's chat template. The processor
(``AutoProcessor`` from the model directory, or ``builtin:tiny-vl``'s) expands
each image into its image tokens, so ``max_prompt_length``, truncation and the
overlong filter count them; truncation never cuts into an image.

Besides the text columns (:meth:`PromptDataset.collate`), a batch has

========================  ============  ================================================
``multi_modal_inputs``    ``object[B]`` the processor's tensors per row: ``pixel_values``
                                         (one row per patch), ``image_grid_thw``
``multi_modal_data``      ``object[B]`` ``{"image": [PIL images]}`` per row (for engines
                                         that take images, not tensors)
========================  ============  ================================================

A picture that cannot be read (missing file, not an image, a mode that does
not convert to RGB) is a :class:`~operators.data.dataset.DatasetError` naming
the file, the row and the picture.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from PIL import Image, UnidentifiedImageError

from operators.data.dataset import (DatasetError, PromptDataset, Truncation, object_array, read_rows, unknown_words,
                                    vocabulary_problem)
from operators.data.shapes import ShapeRows, is_image_task
from operators.models.hf import hf
from operators.models.tiny_vl import build_tiny_vl_processor
from operators.models.vision import MULTI_MODAL_INPUTS

if TYPE_CHECKING:
    from transformers import ProcessorMixin

IMAGE_KEY = "images"
PLACEHOLDER = "<image>"
#: the source fields an image dataset adds to a batch
MULTIMODAL_FIELDS = {MULTI_MODAL_INPUTS: "object[B]", "multi_modal_data": "object[B]"}
#: files that mark a model directory with a processor (``AutoProcessor`` loads it)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(spec: str) -> ProcessorMixin | None:
    """The processor of a model: ``builtin:tiny-vl``'s, or ``AutoProcessor`` from a directory that has one;
    None for a text-only model. Left padding, like every prompt flowrl makes."""
    if spec == "builtin:tiny-vl":
        return build_tiny_vl_processor()
    path = Path(spec).expanduser()
    if spec.startswith("builtin:") or not any((path / name).is_file() for name in PROCESSOR_FILES):
        return None
    try:
        processor = hf("AutoProcessor").from_pretrained(str(path))
    except (OSError, ValueError, ImportError) as err:
        raise DatasetError(f"model {spec!r}: cannot load its processor from {path}: {err}") from None
    processor.tokenizer.padding_side = "left"
    return processor


def is_multimodal(spec: str) -> bool:
    """Whether a data source has images: a builtin image task, or a file with an ``images`` column."""
    if spec.startswith("builtin:"):
        return is_image_task(spec)
    path = Path(spec)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            return IMAGE_KEY in pq.ParquetFile(path).schema_arrow.names
        except Exception:  # noqa: BLE001 - an unreadable file is reported by the loader, with its reason
            return False
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is the loader's to name, with its line
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line.decode("utf-8"))
                except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                    return False
                return isinstance(row, dict) and IMAGE_KEY in row
    return False


def open_image(value: Any, where: str) -> Image.Image:
    """One picture of a row as an RGB PIL image; :class:`DatasetError` naming ``where`` when it cannot be."""
    what = "a PIL image"
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, Mapping):
            if value.get("bytes") is not None:
                what = "bytes"
                image = Image.open(io.BytesIO(value["bytes"]))
            elif value.get("image") is not None:
                return open_image(value["image"], where)
            elif value.get("path"):
                return open_image(value["path"], where)
            else:
                raise DatasetError(f"{where}: the image is a dict with no 'bytes', 'image' or 'path'")
        elif isinstance(value, (str, os.PathLike)):
            what = f"file {os.fspath(value)!r}"
            path = Path(os.fspath(value).removeprefix("file://")).expanduser()
            if not path.is_file():
                raise DatasetError(f"{where}: no such image file {os.fspath(value)!r}")
            image = Image.open(path)
        else:
            raise DatasetError(f"{where}: an image must be a PIL image, a path or a dict with 'bytes' or 'path', "
                               f"not {type(value).__name__}")
        image.load()
        return image if image.mode == "RGB" else image.convert("RGB")
    except DatasetError:
        raise
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DatasetError(f"{where}: cannot read the image ({what}): {err}") from None


def image_messages(messages: Sequence[Mapping[str, Any]], n_images: int, where: str) -> list[dict[str, Any]]:
    """Chat messages with each ``<image>`` as an image part (verl's split); the count must match."""
    out, seen = [], 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or PLACEHOLDER not in content:
            out.append(dict(message))
            continue
        parts = []
        for segment in re.split(f"({re.escape(PLACEHOLDER)})", content):
            if segment == PLACEHOLDER:
                parts.append({"type": "image"})
                seen += 1
            elif segment:
                parts.append({"type": "text", "text": segment})
        out.append({**message, "content": parts})
    if seen != n_images:
        raise DatasetError(f"{where}: the prompt has {seen} {PLACEHOLDER} placeholder(s) but the row has {n_images} "
                           f"image(s) in {IMAGE_KEY!r}; give one image per placeholder")
    return out


class MultimodalPromptDataset(PromptDataset):
    """:class:`PromptDataset` over rows with images, tokenized by the model's processor."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], processor: ProcessorMixin, **kwargs: Any):
        self.processor = processor
        self._processed: dict[int, dict[str, Any]] = {}
        super().__init__(rows, processor.tokenizer, **kwargs)
        self._processed.clear()  # the overlong filter read every row: keep none of their pixels

    def process(self, row_id: int) -> dict[str, Any]:
        """Row ``row_id`` through the processor: ``input_ids`` (a list), ``multi_modal_inputs`` and
        ``multi_modal_data``."""
        if row_id in self._processed:
            return self._processed[row_id]
        where = f"{self.name}: row {row_id}"
        row = self.rows[row_id]
        images = [open_image(value, f"{where}: image {k}") for k, value in enumerate(row.get(IMAGE_KEY) or [])]
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        text = self.processor.apply_chat_template(image_messages(messages, len(images), where),
                                                  add_generation_prompt=True, tokenize=False)
        out = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            words = unknown_words(messages, lambda w: self.tokenizer.encode(w, add_special_tokens=False), unk)
            raise DatasetError(f"{where}: {vocabulary_problem(words, self.tokenizer.unk_token)}")
        tensors = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
        processed = {"input_ids": ids, MULTI_MODAL_INPUTS: tensors, "multi_modal_data": {"image": images}}
        if len(self._processed) < 4096:  # a batch's rows are read twice (length, then columns); keep few
            self._processed[row_id] = processed
        return processed

    def _encode(self, prompt: Any, row_id: int | None = None) -> list[int]:
        return self.process(row_id)["input_ids"]

    def prompt_ids(self, i: int) -> list[int]:
        ids = super().prompt_ids(i)
        if len(ids) < len(self._encode(None, self.row_ids[i])):  # truncated: an image must stay whole
            image_token = self.processor.image_token_id
            full = self._encode(None, self.row_ids[i])
            if full.count(image_token) != ids.count(image_token):
                raise DatasetError(f"{self.name}: row {self.row_ids[i]} has a {len(full)}-token prompt "
                                   f"(image tokens included), over max_prompt_length={self.max_prompt_length}, "
                                   f"and truncation would cut an image; raise max_prompt_length or "
                                   f"filter_overlong_prompts")
        return ids

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        batch = super().collate(indices)
        processed = [self.process(self.row_ids[i]) for i in indices]
        batch[MULTI_MODAL_INPUTS] = object_array([p[MULTI_MODAL_INPUTS] for p in processed])
        batch["multi_modal_data"] = object_array([p["multi_modal_data"] for p in processed])
        self._processed.clear()
        return batch


def load_multimodal_dataset(source: str, processor: ProcessorMixin, *, seed: int = 0, task_size: int = 100_000,
                            max_prompt_length: int | None = None, truncation: Truncation = "error",
                            filter_overlong_prompts: bool = False) -> MultimodalPromptDataset:
    """A builtin image task (``task_size`` rows from ``seed``) or a parquet/jsonl file with ``images``.

    With ``truncation="error"`` and a ``max_prompt_length``, every row is processed here, so an overlong
    prompt or a broken image fails at load time, not mid-run.
    """
    kwargs = {"max_prompt_length": max_prompt_length, "truncation": truncation,
              "filter_overlong_prompts": filter_overlong_prompts}
    if source.startswith("builtin:"):
        return MultimodalPromptDataset(ShapeRows(source, size=task_size, seed=seed), processor, name=source, **kwargs)
    dataset = MultimodalPromptDataset(read_rows(source), processor, name=str(source), **kwargs)
    if max_prompt_length is not None and truncation == "error":
        for i in range(len(dataset)):
            dataset.prompt_ids(i)
        dataset._processed.clear()
    return dataset
