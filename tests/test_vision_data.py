"""Image datasets in verl's layout: a geo3k-style parquet loads unchanged; broken images are named."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from operators.data.dataset import DatasetError, PromptLoader
from operators.data.multimodal import is_multimodal, load_multimodal_dataset, load_processor
from operators.data.shapes import RGB, ShapeRows
from operators.models.tiny_vl import IMAGE_PAD, VOCAB
from operators.sources import PromptSource, PromptSourceConfig

IMAGE_TOKEN = VOCAB.index(IMAGE_PAD)


def _png(color: str, size: tuple[int, int] = (32, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, RGB[color]).save(out, format="PNG")
    return out.getvalue()


def _write_verl_parquet(path, images: list[list[dict]]) -> None:
    """verl's multimodal layout (its geo3k preprocessing): ``images`` as Hugging Face datasets stores
    PIL images (a list of ``{bytes, path}`` structs), ``<image>`` in the user message, the usual columns."""
    n = len(images)
    table = pa.table({
        "data_source": ["hiyouga/geometry3k"] * n,
        "prompt": [[{"role": "user", "content": "<image> what color ?"}]] * n,
        "images": pa.array(images, type=pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": "red"}] * n,
        "extra_info": [{"split": "train", "index": i, "answer": "red", "question": "what color ?"} for i in range(n)],
    })
    pq.write_table(table, path)


def test_a_verl_multimodal_parquet_loads_unchanged(tmp_path):
    path = tmp_path / "geo.parquet"
    colors = ["red", "blue", "green", "yellow"]
    sizes = [(32, 32), (48, 32), (32, 32), (32, 64)]
    _write_verl_parquet(path, [[{"bytes": _png(c, s), "path": None}] for c, s in zip(colors, sizes)])
    assert is_multimodal(str(path))
    processor = load_processor("builtin:tiny-vl")
    dataset = load_multimodal_dataset(str(path), processor)
    batch = PromptLoader(dataset, batch_size=4, shuffle=False).next_batch()
    for row, (color, size) in enumerate(zip(colors, sizes)):
        # what the processor makes of the row by itself: the same ids (left-padded) and the same pixels
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " what color ?"}]}],
            add_generation_prompt=True, tokenize=False)
        alone = processor(text=[text], images=[Image.new("RGB", size, RGB[color])], return_tensors="pt")
        n = alone["input_ids"].shape[1]
        assert batch["input_ids"][row, -n:].tolist() == alone["input_ids"][0].tolist()
        assert batch["attention_mask"][row].sum() == n
        inputs = batch["multi_modal_inputs"][row]
        assert torch.equal(inputs["pixel_values"], alone["pixel_values"])
        assert torch.equal(inputs["image_grid_thw"], alone["image_grid_thw"])
        # the image tokens are in the prompt: one per 2x2 patches of 8x8 pixels
        assert int((batch["input_ids"][row] == IMAGE_TOKEN).sum()) == size[0] * size[1] // 256
        assert batch["multi_modal_data"][row]["image"][0].size == size
    assert batch["ground_truth"].tolist() == ["red"] * 4
    assert batch["extra_info"][1]["question"] == "what color ?"


def test_the_length_limits_count_image_tokens(tmp_path):
    path = tmp_path / "geo.parquet"
    _write_verl_parquet(path, [[{"bytes": _png("red", (32, 32)), "path": None}],
                               [{"bytes": _png("red", (64, 64)), "path": None}]])
    processor = load_processor("builtin:tiny-vl")
    # 32x32: 4 image tokens, 10 in all; 64x64: 16 image tokens, 22 in all
    kept = load_multimodal_dataset(str(path), processor, max_prompt_length=12, filter_overlong_prompts=True)
    assert len(kept) == 1 and kept.row_ids == [0]
    with pytest.raises(DatasetError, match="row 1 has a 22-token prompt"):
        load_multimodal_dataset(str(path), processor, max_prompt_length=12)
    cut = load_multimodal_dataset(str(path), processor, max_prompt_length=12, truncation="left")
    with pytest.raises(DatasetError, match="row 1 .* would cut an image"):
        cut.collate([1])


def test_a_broken_image_names_the_file_and_the_row(tmp_path):
    path = tmp_path / "broken.parquet"
    _write_verl_parquet(path, [[{"bytes": _png("red"), "path": None}], [{"bytes": _png("red"), "path": None}],
                               [{"bytes": b"not a png", "path": None}]])
    dataset = load_multimodal_dataset(str(path), load_processor("builtin:tiny-vl"))
    dataset.collate([0, 1])
    with pytest.raises(DatasetError) as err:
        dataset.collate([2])
    message = str(err.value)
    assert str(path) in message and "row 2" in message and "image 0" in message and "cannot read the image" in message

    missing = tmp_path / "missing.parquet"
    _write_verl_parquet(missing, [[{"bytes": None, "path": str(tmp_path / "nowhere.png")}]])
    with pytest.raises(DatasetError) as err:
        load_multimodal_dataset(str(missing), load_processor("builtin:tiny-vl"), max_prompt_length=64)
    assert "row 0" in str(err.value) and "nowhere.png" in str(err.value)


def test_placeholders_must_match_the_images(tmp_path):
    path = tmp_path / "two.parquet"
    _write_verl_parquet(path, [[{"bytes": _png("red"), "path": None}, {"bytes": _png("blue"), "path": None}]])
    with pytest.raises(DatasetError, match="row 0: the prompt has 1 <image> placeholder"):
        load_multimodal_dataset(str(path), load_processor("builtin:tiny-vl"), max_prompt_length=64)


def test_builtin_shapes_source_batches_carry_images_and_hold_out_validation():
    cfg = PromptSourceConfig(source="builtin:shapes", batch_size=4, val_size=8)
    train = PromptSource(cfg, seed=0, tokenizer="builtin:tiny-vl")
    val = PromptSource(cfg, seed=0, tokenizer="builtin:tiny-vl", split="val")
    batch = train.next_batch()
    assert len(batch) == 4 and batch.non_tensor_batch["multi_modal_inputs"][0]["pixel_values"].shape == (16, 3, 8, 8)
    assert (batch.batch["prompts"] == IMAGE_TOKEN).sum(-1).tolist() == [4] * 4
    # validation draws its pictures from another seed (a small picture space may repeat one by chance)
    val_images = [np.asarray(r["images"][0]).tobytes() for r in ShapeRows("builtin:shapes", size=64, seed=7919)]
    train_images = {np.asarray(r["images"][0]).tobytes() for r in ShapeRows("builtin:shapes", size=64, seed=0)}
    assert len(val.next_batch()) == 8 and sum(image in train_images for image in val_images) < 8
