"""A small built-in training corpus for the lab target model, generated (not copied) from a
seeded toy grammar, so ``init-weights`` can train a tiny byte-level language model in seconds.

The text has learnable structure at several ranges (word spelling, agreement-free sentence
templates, counting runs, capitalised sentence starts) which makes greedy output readable and
speculative acceptance meaningful. ``corpus_text(seed, n_chars) -> str`` is a pure function of
its arguments (``random.Random(seed)``).
"""

from __future__ import annotations

import random

_DET = ["the", "a", "this", "every", "one", "that"]
_ADJ = [
    "small",
    "red",
    "quick",
    "old",
    "quiet",
    "bright",
    "heavy",
    "green",
    "cold",
    "happy",
    "dark",
    "tiny",
    "warm",
    "blue",
    "strange",
]
_NOUN = [
    "cat",
    "dog",
    "house",
    "river",
    "engine",
    "table",
    "garden",
    "bird",
    "window",
    "road",
    "lamp",
    "ship",
    "tree",
    "stone",
    "clock",
    "letter",
    "server",
    "model",
    "token",
    "node",
]
_VERB = [
    "sees",
    "finds",
    "moves",
    "reads",
    "holds",
    "likes",
    "opens",
    "carries",
    "follows",
    "watches",
    "builds",
    "counts",
    "serves",
    "keeps",
]
_PREP = ["near", "under", "behind", "beside", "above", "across", "inside"]
_ADV = ["slowly", "again", "today", "quietly", "at night", "every day", "twice"]


def _np(rng: random.Random) -> str:
    if rng.random() < 0.6:
        return f"{rng.choice(_DET)} {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    return f"{rng.choice(_DET)} {rng.choice(_NOUN)}"


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.45:
        s = f"{_np(rng)} {rng.choice(_VERB)} {_np(rng)}"
    elif r < 0.7:
        s = f"{_np(rng)} {rng.choice(_VERB)} {_np(rng)} {rng.choice(_PREP)} {_np(rng)}"
    elif r < 0.85:
        s = f"{_np(rng)} {rng.choice(_VERB)} {_np(rng)} {rng.choice(_ADV)}"
    else:
        start = rng.randrange(1, 40)
        n = rng.randrange(4, 9)
        return "count " + " ".join(str(start + i) for i in range(n)) + "."
    return s[0].upper() + s[1:] + "."


def corpus_text(seed: int, n_chars: int = 200_000) -> str:
    """Deterministic toy-grammar text of at least ``n_chars`` characters (ASCII only).

    Paragraphs of 3-7 sentences separated by a newline; sentences separated by one space.
    """
    rng = random.Random(seed)
    out: list[str] = []
    total = 0
    while total < n_chars:
        para = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 8))) + "\n"
        out.append(para)
        total += len(para)
    return "".join(out)
