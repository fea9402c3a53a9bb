"""``builtin:tiny-vl``: a tiny vision-language model of a real transformers family, with its processor.

The vision-language twin of ``builtin:tiny``, built from a config with no hub:
a PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``: a 2-layer NaViT vision
tower into a 2-layer language model), a word-level tokenizer with the vision
tokens, and a ``PaddleOCRVLProcessor`` over a PIL image processor.
``save_tiny_vl`` writes one directory that ``AutoProcessor`` and
``AutoModelForImageTextToText`` load.

Why this family: it is Qwen2-VL's design in every part flowrl touches — one
``pixel_values`` row per image patch, ``image_grid_thw`` per image, image tokens
expanded by the processor, and M-RoPE positions from the model's own
``get_rope_index`` (the same signature as Qwen2-VL's and Qwen2.5-VL's) — but
its processor takes images only. Qwen2-VL's processor also builds a video
processor, which needs torchvision, and this machine has none: a saved
Qwen2-VL directory would not load through ``AutoProcessor`` here.

Images are cut into 8×8 patches and every 2×2 patches merge into one token, so
a 32×32 image is 16 rows of ``pixel_values`` and 4 ``<|image_pad|>`` tokens::

    >>> processor = build_tiny_vl_processor()
    >>> from PIL import Image
    >>> text = processor.apply_chat_template(
    ...     [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "color ?"}]}],
    ...     add_generation_prompt=True, tokenize=False)
    >>> out = processor(text=[text], images=[Image.new("RGB", (32, 32))], return_tensors="pt")
    >>> out["pixel_values"].shape, out["image_grid_thw"].tolist(), out["input_ids"].shape
    (torch.Size([16, 3, 8, 8]), [[1, 4, 4]], torch.Size([1, 9]))
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from operators.models.hf import hf
from operators.models.tiny import BOS, EOS, PAD, UNK, tiny_core_tokenizer

# transformers is fetched (:func:`hf`) where something is built: declaring operators does not pay for it
if TYPE_CHECKING:
    from transformers import (PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration, PaddleOCRVLProcessor,
                              PreTrainedTokenizerFast)

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
#: verl's placeholder in message content; a token of its own so a prompt's words read cleanly
IMAGE_PLACEHOLDER = "<image>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD, IMAGE_PLACEHOLDER]
DIGITS = [str(i) for i in range(10)]
COLORS = ["red", "green", "blue", "yellow"]
SHAPES = ["circle", "square", "triangle"]
WORDS = ["what", "color", "how", "many", "shapes", "count", "is", "the", "shape", "answer", "?", ":", "="]
#: the whole vocabulary, in id order (``<pad>`` is 0, ``<bos>`` 1, ``<eos>`` 2)
VOCAB: list[str] = SPECIAL_TOKENS + DIGITS + COLORS + SHAPES + WORDS

#: bos, then each message: a string as it is, a list of parts with each image as Qwen2-VL's vision tokens
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + VISION_START + IMAGE_PAD + VISION_END + " "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% if not loop.last %} {% endif %}{% endfor %}"
)

PATCH, MERGE = 8, 2
HIDDEN = 128


def tiny_vl_core_tokenizer() -> Tokenizer:
    """The word-level ``tokenizers`` core (no transformers): what ``flowrl validate`` reads prompts with."""
    return tiny_core_tokenizer(VOCAB, SPECIAL_TOKENS)


def build_tiny_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of ``builtin:tiny-vl``: left padding, the chat template, Qwen2-VL's image token."""
    PreTrainedTokenizerFast = hf("PreTrainedTokenizerFast")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_vl_core_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=512,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_start_token": VISION_START, "vision_end_token": VISION_END},
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_vl_processor() -> PaddleOCRVLProcessor:
    """Image processor (8×8 patches, 2×2 merge, images kept between 16×16 and 64×64) and tokenizer."""
    image_processor = hf("PaddleOCRVLImageProcessorPil")(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=1,
        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    return hf("PaddleOCRVLProcessor")(image_processor=image_processor, tokenizer=build_tiny_vl_tokenizer(),
                                      chat_template=CHAT_TEMPLATE)


def tiny_vl_config() -> PaddleOCRVLConfig:
    """A 2-layer vision tower (width 64) into a 2-layer language model (hidden 128, 4 heads, MLP 512)."""
    ids = {token: VOCAB.index(token) for token in SPECIAL_TOKENS}
    head_dim = HIDDEN // 4
    return hf("PaddleOCRVLConfig")(
        text_config={
            "vocab_size": len(VOCAB), "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": head_dim,
            "max_position_embeddings": 512, "bos_token_id": ids[BOS], "eos_token_id": ids[EOS],
            "pad_token_id": ids[PAD],
            # temporal, height and width shares of the rotary half-dimension (M-RoPE)
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
        },
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": PATCH, "spatial_merge_size": MERGE},
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )


def build_tiny_vl_model(seed: int = 0) -> PaddleOCRVLForConditionalGeneration:
    """A freshly initialised ``builtin:tiny-vl``; same seed, same weights; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return hf("PaddleOCRVLForConditionalGeneration")(tiny_vl_config())


def save_tiny_vl(path: str | Path, seed: int = 0) -> Path:
    """Write ``builtin:tiny-vl`` (weights, tokenizer, processor) as one Hugging Face directory."""
    path = Path(path)
    build_tiny_vl_model(seed).save_pretrained(path)
    build_tiny_vl_processor().save_pretrained(path)
    return path
