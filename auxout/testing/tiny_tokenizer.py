"""A small byte-level BPE tokenizer and chat template for the tiny MoE checkpoints, built offline.

The tiny models need a real tokenizer so ``auxout serve`` can take text and chat messages like a
production server. It is trained locally with the ``tokenizers`` library on a fixed synthetic
corpus (deterministic, no download) to exactly the model's vocabulary size, so every token id
the model accepts is also a token the tokenizer knows (token-id prompts stay valid). Ids 0, 1,
2 are pad, bos and eos, as in the model config; the chat template uses ``<|im_start|>`` /
``<|im_end|>`` markers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEXT = (
    "The router of a mixture of experts layer picks the top k experts for every token. "
    "Reinforcement learning replays the routing the rollout engine used, so training sees the same experts. "
    "You are a helpful assistant. What is the weather like today? Please answer the question step by step. "
    "user assistant system tool call function result observation reward policy value gradient "
)
_SYLLABLES = ("ka", "to", "ri", "me", "an", "su", "lo", "ne", "di", "pa", "er", "ing", "th", "qu", "ou", "ex")


def _corpus(seed: int = 0) -> list[str]:
    """Fixed text plus seeded pseudo-words: enough distinct pairs for every merge of the vocabulary."""
    rng = np.random.default_rng(seed)
    lines = [_TEXT] * 8
    for _ in range(400):
        words = []
        for _ in range(12):
            parts = rng.integers(0, len(_SYLLABLES), size=int(rng.integers(1, 4)))
            words.append("".join(_SYLLABLES[p] for p in parts))
        lines.append(" ".join(words) + " " + " ".join(str(int(n)) for n in rng.integers(0, 1000, size=4)))
    return lines


def write_tokenizer(out: Path, vocab_size: int, *, bos_id: int = 1, eos_id: int = 2, pad_id: int = 0) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (pad_id, bos_id, eos_id) != (0, 1, 2):
        raise ValueError(f"the tiny tokenizer puts pad, bos, eos at 0, 1, 2; the model config has {pad_id, bos_id, eos_id}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer reached {tok.get_vocab_size()} tokens, the model needs {vocab_size}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[bos_id],
        "eos_token": SPECIAL_TOKENS[eos_id],
        "pad_token": SPECIAL_TOKENS[pad_id],
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
