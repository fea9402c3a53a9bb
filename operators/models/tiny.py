"""``builtin:tiny``: a 0.53M-parameter Llama over a word-level vocabulary, built locally.

It exists so the default graph runs on a 2-core CPU with no model hub: the
tokenizer is made from a fixed word list with the ``tokenizers`` library and the
model from a config, both as ordinary transformers objects that
``save_pretrained`` writes as a normal Hugging Face directory.

Digits are separate tokens (``"37"`` → ``3 7``), so arithmetic-style tasks see
one token per digit::

    >>> tok = build_tiny_tokenizer()
    >>> tok.decode(tok.encode("copy 37 =", add_special_tokens=False))
    'copy 3 7 ='
    >>> tok.apply_chat_template([{"role": "user", "content": "copy 3 7 ="}],
    ...                         add_generation_prompt=True, tokenize=False)
    '<bos>copy 3 7 ='
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from operators.models.hf import hf

# transformers is fetched (:func:`hf`) where a tokenizer or a model is built, so declaring operators
# (``flowrl validate``) does not pay for it
if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
DIGITS = [str(i) for i in range(10)]
SYMBOLS = ["+", "-", "=", ":", ",", "####"]
WORDS = ["copy", "add", "reverse", "sum", "max", "min", "sort", "answer", "?"]
#: the whole vocabulary, in id order (``<pad>`` is 0, ``<bos>`` 1, ``<eos>`` 2)
VOCAB: list[str] = SPECIAL_TOKENS + DIGITS + SYMBOLS + WORDS

#: bos, then the message contents joined by spaces; the generation prompt adds nothing,
#: so a task prompt ``"copy 3 7 ="`` is followed directly by the answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %} {% endif %}{% endfor %}"
)


def tiny_core_tokenizer(vocab: list[str] = VOCAB, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """The word-level ``tokenizers`` core of :func:`build_tiny_tokenizer`, without transformers: enough to
    tell which words it knows (``flowrl validate`` reads prompts with it). ``vocab``: another word list
    (``builtin:tiny-vl``'s), special tokens first."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    core.add_special_tokens(special_tokens)
    return core


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer of ``builtin:tiny`` (left padding, chat template set).

    Example::

        >>> tok = build_tiny_tokenizer()
        >>> tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
        (0, 1, 2)
        >>> tok.encode("add 3 4 =", add_special_tokens=False)
        [21, 7, 8, 16]
    """
    PreTrainedTokenizerFast = hf("PreTrainedTokenizerFast")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_core_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config() -> LlamaConfig:
    """Hidden 128, 2 layers, 4 heads, MLP 512, tied embeddings: 528,640 parameters."""
    LlamaConfig = hf("LlamaConfig")
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=VOCAB.index(PAD),
        bos_token_id=VOCAB.index(BOS),
        eos_token_id=VOCAB.index(EOS),
    )


def build_tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised ``builtin:tiny`` causal LM; same seed, same weights.

    The global torch RNG is left as it was.

    Example::

        >>> a, b = build_tiny_model(seed=1), build_tiny_model(seed=1)
        >>> torch.equal(a.lm_head.weight, b.lm_head.weight)
        True
    """
    LlamaForCausalLM = hf("LlamaForCausalLM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config())
