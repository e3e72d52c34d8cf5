"""Byte-level tokenizer of the lab model and its compressing Engram token map.

Raw ids (vocab 260): 0 ``<|bos|>``, 1 ``<|eos|>``, 2 ``<|pad|>``, 3 ``<|sep|>``, then byte ``b``
is raw id ``b + 4``. The pad raw id is 2, matching ``engram_pad_token_id`` (engram-spec.md
section 3: "the pad raw id 2 maps to 2").

The token map (raw id -> compressed id) is derived deterministically from a normalisation chain
like the real one (engram-spec.md section 3) but over bytes: ASCII case folding (``A``-``Z`` ->
``a``-``z``) and whitespace folding (TAB, LF, VT, FF, CR -> SPACE). Specials map to themselves;
the remaining normalised bytes get compressed ids 4.. in ascending byte order. 260 raw ids ->
229 compressed ids. The same map feeds ``dsv41.engram.hashing.NgramHasher``.
"""

from __future__ import annotations

import codecs
import hashlib

import numpy as np

from dsv41.errors import Dsv41Error

BOS, EOS, PAD, SEP = 0, 1, 2, 3
SPECIALS = {"<|bos|>": BOS, "<|eos|>": EOS, "<|pad|>": PAD, "<|sep|>": SEP}
BYTE_OFFSET = 4
VOCAB_SIZE = 256 + BYTE_OFFSET
_WS = (9, 10, 11, 12, 13)


def _normalise_byte(b: int) -> int:
    """One byte through the normalisation chain (case fold, whitespace fold)."""
    if 65 <= b <= 90:
        return b + 32
    if b in _WS:
        return 32
    return b


def build_token_map() -> np.ndarray:
    """The raw -> compressed token map.

    Returns int32[260]; ``map[2] == 2`` (pad). Deterministic: no inputs, no randomness.
    """
    norm = sorted({_normalise_byte(b) for b in range(256)})
    cid = {nb: BYTE_OFFSET + i for i, nb in enumerate(norm)}
    out = np.empty(VOCAB_SIZE, dtype=np.int32)
    for raw in range(BYTE_OFFSET):
        out[raw] = raw
    for b in range(256):
        out[b + BYTE_OFFSET] = cid[_normalise_byte(b)]
    return out


TOKEN_MAP = build_token_map()
COMPRESSED_VOCAB_SIZE = int(TOKEN_MAP.max()) + 1  # 229
TOKEN_MAP_SHA256 = hashlib.sha256(TOKEN_MAP.astype("<i4").tobytes()).hexdigest()


# Message roles the chat endpoint accepts: OpenAI's chat roles (``function`` is its deprecated
# form of ``tool``); anything else is a client error, as in the OpenAI API.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ByteTokenizer:
    """Encode text to raw ids and decode ids back to text.

    ``encode(text, bos=False) -> list[int]`` (UTF-8 bytes + 4, optional leading BOS);
    ``decode(ids) -> str`` (specials are dropped, invalid UTF-8 replaced with U+FFFD).
    Raises ``Dsv41Error`` for ids outside ``[0, 260)``.
    """

    vocab_size = VOCAB_SIZE
    bos_id, eos_id, pad_id, sep_id = BOS, EOS, PAD, SEP

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids (byte b -> b + 4), with a leading BOS when ``bos``."""
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS] + ids if bos else ids

    def check_ids(self, ids: list[int]) -> None:
        """``Dsv41Error`` unless every id is a (non-bool) int in ``[0, VOCAB_SIZE)``."""
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
                raise Dsv41Error(f"token id {t!r} is outside the vocabulary [0, {VOCAB_SIZE})")

    def to_bytes(self, ids: list[int]) -> bytes:
        """The raw bytes of ``ids`` (special ids dropped); ``Dsv41Error`` on ids outside the vocabulary."""
        self.check_ids(ids)
        return bytes(t - BYTE_OFFSET for t in ids if t >= BYTE_OFFSET)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``: specials dropped, invalid UTF-8 replaced with U+FFFD."""
        return self.to_bytes(ids).decode("utf-8", errors="replace")

    def incremental(self) -> IncrementalDecoder:
        """A streaming decoder: ``feed(ids) -> str`` returns only complete characters."""
        return IncrementalDecoder(self)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The lab chat template: BOS, then per message ``SEP role ": " content "\\n"``, then
        ``SEP "assistant: "``. Raises ``Dsv41Error`` on a malformed message (not a dict, a role
        outside ``CHAT_ROLES``, content neither a string nor a list of text parts)."""
        ids = [BOS]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise Dsv41Error(f"messages[{i}] needs a string 'role'")
            if m["role"] not in CHAT_ROLES:
                raise Dsv41Error(f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: only text parts exist here
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise Dsv41Error(f"messages[{i}].content: only text parts are supported")
                    parts.append(p["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise Dsv41Error(f"messages[{i}] needs string 'content'")
            ids += [SEP] + self.encode(f"{m['role']}: {content}\n")
        ids += [SEP] + self.encode("assistant: ")
        return ids


class IncrementalDecoder:
    """UTF-8 decoding of a token stream that never splits a character across chunks."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int], final: bool = False) -> str:
        """Text completed by ``ids`` (a split character waits for its next bytes; ``final``
        flushes it as U+FFFD)."""
        return self._dec.decode(self._tok.to_bytes(ids), final=final)
