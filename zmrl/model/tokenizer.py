"""A byte-level BPE tokenizer trained locally (no hub) on generated arithmetic text.

Saved as HF fast-tokenizer files (tokenizer.json + tokenizer_config.json), which both
transformers' AutoTokenizer and vLLM load. Special tokens: <|endoftext|> (eos, also bos)
and <|pad|>, ids 0 and 1.
"""
from __future__ import annotations

import random
from pathlib import Path

EOS, PAD = "<|endoftext|>", "<|pad|>"


def arithmetic_corpus(num_lines: int = 20000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["What is", "Compute", "Answer:", "The answer is", "Question:", "so", "then", "and", "equals",
             "Let x be", "Solve for x:", "step", "Therefore", "total", "sum", "product", "difference"]
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        val = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{rng.choice(words)} {a} {op} {b}? {rng.choice(words)} {a} {op} {b} = {val}.")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """-> a transformers PreTrainedTokenizerFast with at most `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(arithmetic_corpus(seed=seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD)


def check_tokenizer(tokenizer, vocab_size: int, where: str = "tokenizer") -> None:
    """The tokenizer's ids must fit the model's vocabulary exactly."""
    if len(tokenizer) != vocab_size:
        raise ValueError(f"{where} has {len(tokenizer)} tokens but the config's vocab_size is {vocab_size}")


def save_tokenizer(tokenizer, out: str | Path) -> None:
    tokenizer.save_pretrained(str(out))
