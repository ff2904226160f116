"""Texts and tokenizers that stress tokenization at a cut: shared by the tests that hold
the router's tokenization (prefix reuse, word ids) against the tokenizer itself."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Fragments chosen to stress the GPT-2 regex at a cut: contractions, digit runs, whitespace
# runs of every kind (Unicode spaces the regex and Python may disagree on), punctuation runs,
# multi-byte characters, combining marks, and the added tokens' text (whole and broken).
FRAGMENTS = [
    *["the", "router", "Cache", "é", "東京", "🚀", "e\u0301", "ß", "x"],
    *["'s", "'t", "'re", "'ll", "'d", "'", "don't", "12", "3.14", "٣", "²"],
    *[" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n", "\xa0", "\u3000", "\u2028", "\x85", "\x1c"],
    *["\u200b", "\ufeff", ".", ",", "!?", "--", "()", "{'a': 1}", "#", "$"],
    *["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|im", "_start|>", "<", "s>"],
]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)
any_texts = st.text(max_size=120)


def train_tokenizer(folder: Path) -> Path:
    """A GPT-2-style byte-level BPE with merges inside whitespace runs ("  ", "\n\n"),
    contractions and digits: the cases where a wrong cut would change the tokens."""
    rng = random.Random(0)
    corpus = ["".join(rng.choice(FRAGMENTS) for _ in range(60)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=alphabet, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    return folder
