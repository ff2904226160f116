"""Build the project's tiny byte-level BPE tokenizer, deterministically and offline.

The simulated engines, the router's local tokenizer and the real-vLLM conformance model all
load the same folder, so token ids agree everywhere. No weights or vocabularies can be
downloaded on the machines this project is built on, so the tokenizer is trained here on
seeded English-like text.

    python -m engines.sim.make_tokenizer [--out DIR]

Ids: `<s>` 0 (BOS, added to completion prompts like a Llama tokenizer), `</s>` 1 (EOS),
`<|im_start|>` 2 and `<|im_end|>` 3 (chat turns). There is no `<unk>`: byte-level BPE can
spell every byte, so an unknown token could never be produced.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "tokenizer"
VOCAB_SIZE = 2048
SEED = 20240601
MODEL_MAX_LENGTH = 4096

BOS = "<s>"
EOS = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # list order = ids 0..3

# ChatML turns behind a Llama-style BOS. Chat requests are encoded without automatic specials
# (vLLM's default for chat), so the template's own `bos_token` is the only BOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Roughly the most frequent English words, most frequent first.
_COMMON_TEXT = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross "
    "farm hard start might story saw far sea draw left late run while press close night real "
    "life few north open seem together next white children begin got walk example ease paper "
    "group always music those both mark often letter until mile river car feet care second "
    "book carry took science eat room friend began idea fish mountain stop once base hear "
    "horse cut sure watch color face wood main enough plain girl usual young ready above ever "
    "red list though feel talk bird soon body dog family direct pose leave song measure door "
    "product black short numeral class wind question happen complete ship area half rock "
    "order fire south problem piece told knew pass since top whole king space heard best hour "
    "better true during hundred five remember step early hold west ground interest reach fast "
    "verb sing listen six table travel less morning ten simple several vowel toward war lay "
    "against pattern slow center love person money serve appear road map rain rule govern "
    "pull cold notice voice unit power town fine certain fly fall lead cry dark machine note "
    "wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free minute strong "
    "special mind behind clear tail produce fact street inch multiply nothing course stay "
    "wheel full force blue object decide surface deep moon island foot system busy test "
    "record boat common gold possible plane stead dry wonder laugh thousand ago ran check "
    "game shape equate miss brought heat snow tire bring yes distant fill east paint language "
    "among cache router request token block prefix worker engine model prompt reply server "
    "user assistant message content role chat"
)

_ONSETS = (
    *("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"),
    *("br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr", "qu", "sp", ""),
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "x")
_SUFFIXES = ("", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness")


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.choice((1, 2, 2, 3, 3, 4))
    parts = (
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )
    return "".join(parts) + rng.choice(_SUFFIXES)


def _lexicon(rng: random.Random) -> list[str]:
    """Real words first (they get the most weight), then seeded pseudo-words, so the trainer
    has enough distinct words to fill 2048 ids."""
    words = list(dict.fromkeys(_COMMON_TEXT.split()))
    seen = set(words)
    while len(words) < 6000:
        word = _pseudo_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _sentence(rng: random.Random, words: list[str], weights: list[float]) -> str:
    picked = rng.choices(words, weights=weights, k=rng.randint(4, 18))
    if rng.random() < 0.15:
        picked.insert(rng.randrange(len(picked)), str(rng.randint(0, 9999)))
    if len(picked) > 6 and rng.random() < 0.4:
        cut = rng.randrange(2, len(picked) - 2)
        picked[cut] += ","
    return picked[0].capitalize() + " " + " ".join(picked[1:]) + rng.choice(".....?!:")


def corpus(seed: int = SEED, paragraphs: int = 4000) -> Iterator[str]:
    """Seeded English-like paragraphs with a Zipf-like word distribution."""
    rng = random.Random(seed)
    words = _lexicon(rng)
    weights = [1.0 / (rank + 10) for rank in range(len(words))]
    for _ in range(paragraphs):
        count = rng.randint(1, 6)
        yield " ".join(_sentence(rng, words, weights) for _ in range(count)) + "\n"


def train(seed: int = SEED) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    # Same template transformers rebuilds from add_bos_token=True, so HF, vLLM and the plain
    # `tokenizers` library all add exactly one BOS to a completion prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, 0)],
    )
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict[str, Any]:
    return {"bos_token": BOS, "eos_token": EOS}


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_tokenizer_files(out: Path, seed: int = SEED) -> list[Path]:
    """Train and write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train(seed)
    # Re-serialised through `json` so the file layout does not depend on the Rust
    # pretty-printer; key order inside the tokenizer object is kept as written.
    texts = {
        "tokenizer.json": json.dumps(json.loads(tokenizer.to_str()), ensure_ascii=False) + "\n",
        "tokenizer_config.json": _dump(tokenizer_config()),
        "special_tokens_map.json": _dump(special_tokens_map()),
    }
    paths = []
    for name, text in texts.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for path in write_tokenizer_files(args.out, args.seed):
        print(f"{path} {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
