"""The prompt mixes of `kvroute bench proxy`, as wrk Lua scripts, and the tokenizer's own
cost for prompts built the same way (the floor a tokenizing router cannot go under).

- repeated: one ~2k-token prompt, every request (what a content cache answers at once);
- shared-prefix: one ~2k-token prefix, then a distinct ~30-token tail per request;
- distinct: every request ~2k tokens of its own from the first token on (words of a small
  vocabulary, as natural text repeats its words);
- novel-words: like distinct, but each word made of 2-4 random syllables (~10^5-10^7 words),
  so almost every word is new to the router too: what kvroute costs when it remembers
  nothing of the text it is sent (identifiers, code, rare words).

Every request's text is distinct: a run-unique salt (wrk's Lua states start identical, and
runs must not see each other's prompts) and a request counter open the varying part.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.textgen import WORDS, filler
from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

MODEL = "kvroute-sim"
MIXES = ("repeated", "shared-prefix", "distinct", "novel-words")
PROMPT_TOKENS = 2000
TAIL_WORDS = 6  # + "Question <salt>-<n>:": ~30 tokens
SENTENCE = 40  # words per sentence, as `router.textgen.filler` writes them

_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local words = {%(words)s}
local head = [==[%(head)s]==]
local foot = [==[%(foot)s]==]
local count = %(count)d
local salt = "0"
local n = 0
function init(args)
  salt = args[1] or "0"
  math.randomseed(tonumber(args[2]) or 1)
end
local syllables = {%(syllables)s}
local function word()
  if #syllables == 0 then return words[math.random(#words)] end
  local w = {}
  for _ = 1, math.random(2, 4) do w[#w + 1] = syllables[math.random(#syllables)] end
  return table.concat(w)
end
function request()
  n = n + 1
  local parts = {%(opening)s}
  for i = 1, count do
    parts[#parts + 1] = word()
    if i %% %(sentence)d == 0 then parts[#parts + 1] = "." end
  end
  return wrk.format(nil, nil, nil, head .. table.concat(parts, " ") .. foot)
end
"""
# novel-words: 64 syllables, 2-4 per word
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"][:64]


def _body_around(prompt_head: str) -> tuple[str, str]:
    """The JSON body split around the varying part of the prompt."""
    marker = "\x00VARY\x00"
    body = json.dumps({"model": MODEL, "prompt": prompt_head + marker, "max_tokens": 1})
    head, foot = body.split(json.dumps(marker)[1:-1])
    return head, foot


def _opening(mix: str) -> tuple[str, str]:
    """Lua table opening the varying part, and the Python twin's format string."""
    if mix == "shared-prefix":
        return '"Question", salt .. "-" .. n .. ":"', "Question {salt}-{n}:"
    return 'salt .. "-" .. n .. ":"', "{salt}-{n}:"


class Mix:
    """One prompt mix: its wrk script and a Python twin making prompts the same way."""

    def __init__(self, name: str, tok: LocalTokenizer) -> None:
        self.name = name
        self.prefix = ""
        self.syllables = SYLLABLES if name == "novel-words" else []
        if name == "repeated":
            self.prefix, self.count = filler(tok, PROMPT_TOKENS, random.Random(3)), 0
        elif name == "shared-prefix":
            self.prefix = filler(tok, PROMPT_TOKENS, random.Random(5)) + "\n\n"
            self.count = TAIL_WORDS
        else:
            self.count = _words_for(tok, PROMPT_TOKENS, self._word)

    def prompt(self, salt: str, n: int, rng: random.Random) -> str:
        """What request `n` of a run salted `salt` sends (the Python twin of the Lua)."""
        if self.name == "repeated":
            return self.prefix
        parts = [_opening(self.name)[1].format(salt=salt, n=n)]
        for i in range(1, self.count + 1):
            parts.append(self._word(rng))
            if i % SENTENCE == 0:
                parts.append(".")
        return self.prefix + " ".join(parts)

    def _word(self, rng: random.Random) -> str:
        if not self.syllables:
            return rng.choice(WORDS)
        return "".join(rng.choice(self.syllables) for _ in range(rng.randint(2, 4)))

    def lua(self) -> str:
        if self.name == "repeated":
            body = json.dumps({"model": MODEL, "prompt": self.prefix, "max_tokens": 1})
            return _LUA.split("local words")[0] + f"wrk.body = [==[{body}]==]\n"
        head, foot = _body_around(self.prefix)
        return _LUA % {
            "words": ", ".join(json.dumps(w) for w in WORDS),
            "head": head,
            "foot": foot,
            "count": self.count,
            "opening": _opening(self.name)[0],
            "sentence": SENTENCE,
            "syllables": ", ".join(json.dumps(x) for x in self.syllables),
        }

    def write(self, folder: Path) -> Path:
        path = folder / f"{self.name}.lua"
        path.write_text(self.lua())
        return path


def _words_for(tok: LocalTokenizer, tokens: int, word: Callable[[random.Random], str]) -> int:
    rng = random.Random(1)
    text = " ".join(word(rng) for _ in range(1000))
    per_word = len(tok.completion(text)) / 1000
    return round(tokens / per_word)


def floor(mix: Mix, samples: int = 60) -> dict[str, Any]:
    """The packaged tokenizer's own CPU time for prompts of this mix, encoded whole:
    `encode` (what the issue's ~1.1 ms is) and `encode_batch_fast` (no offsets)."""
    tok = LocalTokenizer(PACKAGED_TOKENIZER)._tok
    rng = random.Random(7)
    prompts = [mix.prompt("floor", n, rng) for n in range(samples)]
    out = {
        "tokens": round(statistics.median(len(tok.encode(p).ids) for p in prompts)),
        "encode_cpu_us": _cpu_us(lambda p: tok.encode(p), prompts),
        "encode_fast_cpu_us": _cpu_us(lambda p: tok.encode_batch_fast([p]), prompts),
    }
    if mix.name == "shared-prefix":  # what is new in each request: its tail
        tails = [p[len(mix.prefix) :] for p in prompts]
        out["tail_tokens"] = round(statistics.median(len(tok.encode(t).ids) for t in tails))
        out["tail_encode_cpu_us"] = _cpu_us(lambda p: tok.encode(p), tails)
    return out


def _cpu_us(fn: Callable[[str], object], prompts: list[str]) -> float:
    fn(prompts[0])
    times = []
    for p in prompts:
        t0 = time.thread_time()
        fn(p)
        times.append(time.thread_time() - t0)
    return round(statistics.median(times) * 1e6, 1)
