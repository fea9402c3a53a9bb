"""``builtin:tiny-tools``: ``builtin:tiny``'s architecture over a vocabulary that can call tools.

``builtin:tiny``'s word-level vocabulary cannot write tool-call markup, and
growing it would change the default job's initial weights, so the tool task
gets its own builtin. Its tokenizer is lossless on the text it covers: a
pre-tokenizer isolates every vocabulary piece, spaces included, and the decoder
concatenates them back, so ``decode(encode(text)) == text`` and a tool call the
model writes parses as JSON. Whole JSON fragments of the calculator's call are
single tokens, which keeps a call at 12 tokens::

    >>> tok = build_tiny_tools_tokenizer()
    >>> call = '<tool_call>{"name": "add", "arguments": {"a": 37, "b": 48}}</tool_call>'
    >>> len(tok.encode(call, add_special_tokens=False)), tok.decode(tok.encode(call, add_special_tokens=False)) == call
    (12, True)

The chat template follows the Hermes/Qwen layout in miniature: a role token
opens each turn, ``<|end|>`` closes user, system and tool turns and ``<eos>``
closes the assistant's, so the model's stop token is the template's own::

    >>> tok.apply_chat_template([{"role": "user", "content": "37+48="}], add_generation_prompt=True,
    ...                         tokenize=False)
    '<bos><|user|>37+48=<|end|><|assistant|>'

The model (:func:`build_tiny_tools_model`) starts from a short supervised
warm-up of the call format (see :func:`operators.data.tool_tasks.warmup_batch`):
it learns how to call the calculator and to copy its answer, and, noisily,
which numbers to send (right in about one sampled call of five);
reinforcement learning makes the sampled policy reliable. The warm-up takes
~1-3 minutes on one busy CPU core the first time and is cached on disk
(``~/.cache/flowrl``, or ``$FLOWRL_CACHE_DIR``) under a hash of its recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from operators.data.tool_tasks import WARMUP_CORRECT_SHARE, warmup_batch
from operators.models.hf import hf
from operators.models.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

# transformers is fetched (:func:`hf`) where a tokenizer or a model is built, so declaring operators
# (``flowrl validate``) does not pay for it
if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
TOOL_MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: the calculator call's JSON, cut into the pieces the model writes as one token each
JSON_PIECES = ['{"name": "', '", "arguments": {', '"a": ', ', "b": ', "}}"]
CHARS = list("0123456789") + list(" \n{}[]\":,.+-*/=?_'")
WORDS = ["add", "mul", "sub", "calc", "name", "arguments", "a", "b", "x", "error", "answer", "tool",
         "unknown", "the", "is", "call", "result", "Error", "invalid", "JSON", "timeout", "true", "false"]
#: the whole vocabulary, in id order (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, as in builtin:tiny)
VOCAB: list[str] = SPECIAL_TOKENS + ROLE_TOKENS + TOOL_MARKUP + JSON_PIECES + CHARS + WORDS

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: warm-up length and learning rate (a fixed recipe: same seed, same warmed-up weights)
WARMUP_STEPS = 300
WARMUP_LR = 3e-3
WARMUP_BATCH = 64


def tiny_tools_core_tokenizer() -> Tokenizer:
    """The ``tokenizers`` core of :func:`build_tiny_tools_tokenizer`, without transformers (for validate)."""
    pieces = [t for t in VOCAB if len(t) > 1 and t not in SPECIAL_TOKENS]
    pattern = "|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True)) + r"|\d|[A-Za-z_]+|[\s\S]"
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    return core


def build_tiny_tools_tokenizer() -> PreTrainedTokenizerFast:
    """The lossless tokenizer of ``builtin:tiny-tools`` (left padding, chat template set).

    Example::

        >>> tok = build_tiny_tools_tokenizer()
        >>> tok.decode(tok.encode("<|tool|>85<|end|>", add_special_tokens=False))
        '<|tool|>85<|end|>'
    """
    PreTrainedTokenizerFast = hf("PreTrainedTokenizerFast")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tools_core_tokenizer(), bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=256, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_tools_config() -> LlamaConfig:
    """``builtin:tiny``'s shape (hidden 128, 2 layers, 4 heads) over the tool vocabulary."""
    LlamaConfig = hf("LlamaConfig")
    return LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=VOCAB.index(PAD), bos_token_id=VOCAB.index(BOS),
        eos_token_id=VOCAB.index(EOS),
    )


def _cache_path(seed: int) -> Path:
    recipe = json.dumps([VOCAB, CHAT_TEMPLATE, WARMUP_STEPS, WARMUP_LR, WARMUP_BATCH, WARMUP_CORRECT_SHARE, seed,
                         torch.__version__])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    root = Path(os.environ.get("FLOWRL_CACHE_DIR", Path.home() / ".cache" / "flowrl"))
    return root / f"tiny-tools-{digest}.pt"


@lru_cache(maxsize=4)
def _warmed_up_state(seed: int) -> dict[str, torch.Tensor]:
    # the warm-up is a pure function of the recipe: keep its result on disk, keyed by the recipe
    path = _cache_path(seed)
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError):
            pass  # a torn or foreign file: warm up again and overwrite it
    state = _warm_up(seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(state, tmp)
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: warm up in every process instead
    return state


def _warm_up(seed: int) -> dict[str, torch.Tensor]:
    LlamaForCausalLM = hf("LlamaForCausalLM")
    tokenizer = build_tiny_tools_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_tools_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR)
        model.train()
        for step in range(WARMUP_STEPS):
            ids, attention, loss_mask = warmup_batch(tokenizer, WARMUP_BATCH, seed=seed * 100_003 + step)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_tiny_tools_model(seed: int = 0) -> LlamaForCausalLM:
    """The ``builtin:tiny-tools`` policy: initialised from ``seed``, then warmed up on the call format.

    The warm-up is deterministic (same seed, same weights) and takes a few
    seconds on one core; it runs once per process and seed. The global torch
    RNG is left as it was.
    """
    LlamaForCausalLM = hf("LlamaForCausalLM")
    model = LlamaForCausalLM(tiny_tools_config())
    model.load_state_dict(_warmed_up_state(seed))
    return model.eval()
