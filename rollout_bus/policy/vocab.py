"""The policy's vocabulary: one token per character, made here (no tokenizer to download).

The calculator task needs digits, ``+``, a question mark, a tool call and the tool's answer marker,
and little else: a vocabulary this small lets a randomly initialised model find the task's reward by
chance, and keeps every log-prob the bus carries checkable by hand.

Contract: ``VOCAB`` maps text to int64 ids and back; ``encode`` names the first character it does not
know and where it is (``ConfigError``); ``decode`` shows an id it does not know as ``<id>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout_bus.errors import ConfigError, must_be

PAD, BOS, EOS, CALL, PLUS, ANSWER, QUESTION = "·", "^", "$", "@", "+", "=", "?"
DIGITS = "0123456789"
CHARACTERS = PAD + BOS + EOS + CALL + PLUS + ANSWER + QUESTION + DIGITS


@dataclass(frozen=True)
class CharVocab:
    """A character vocabulary: id i is ``characters[i]``."""

    characters: str
    ids: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(set(self.characters)) != len(self.characters):
            raise ConfigError(must_be("vocabulary characters", "distinct", self.characters))
        object.__setattr__(self, "ids", {c: i for i, c in enumerate(self.characters)})

    def __len__(self) -> int:
        return len(self.characters)

    def id(self, character: str) -> int:
        return self.ids[character]

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.array([self.ids[c] for c in text], dtype=np.int64)
        except KeyError:
            at = next(i for i, c in enumerate(text) if c not in self.ids)
            raise ConfigError(must_be(f"character {at} of {text!r}", f"one of {self.characters!r}",
                                      text[at])) from None

    def decode(self, ids) -> str:
        return "".join(self.characters[i] if 0 <= i < len(self.characters) else f"<{i}>"
                       for i in (int(t) for t in ids))


VOCAB = CharVocab(CHARACTERS)
