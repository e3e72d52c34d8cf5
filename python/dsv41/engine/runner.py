"""Single-process TP1 API of the lab target (what the drafter engineer distils from).

``LocalRunner(config_path, weights_path, row_source, device="cpu")``;
``generate(prompt_ids, max_tokens) -> GenerateResult``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv41.engine.model import TargetModel
from dsv41.engine.model_config import load_config
from dsv41.engine.tp import LocalComm
from dsv41.engine.weights import load_weights, target_identity
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import VOCAB_SIZE


@dataclass
class GenerateResult:
    """``tokens``: the ``max_tokens`` greedy tokens generated (EOS does not stop generation);
    ``hidden_tap``: float32 ``[len(prompt) + len(tokens), H]``, row i = the tap hidden
    (``drafter_tap_layer``, mean of the hc copies) after the target consumed token i of
    ``prompt + tokens``; row i produced token i+1."""

    tokens: list[int]
    hidden_tap: np.ndarray


class LocalRunner:
    """The lab target in this process (TP1), greedy.

    ``row_source``: a ``dsv41.engram.rowsource.RowSource`` (e.g. ``dsv41.engram.sources.from_env(...)``).
    Raises ``Dsv41Error``/``ConfigError`` for a bad config or weights file.
    """

    def __init__(self, config_path, weights_path, row_source, device: str = "cpu") -> None:
        self.cfg = load_config(config_path)
        self.identity = target_identity(config_path, weights_path)
        self.model = TargetModel(self.cfg, load_weights(self.cfg, weights_path), LocalComm(), row_source, device)

    def generate(self, prompt_ids: list[int], max_tokens: int, chunk: int = 512) -> GenerateResult:
        """Greedy decode ``max_tokens`` tokens after ``prompt_ids`` (prefill in ``chunk``-token
        chunks). Raises ``Dsv41Error`` on an empty prompt, bad ids, or a too-long request."""
        import torch

        if not prompt_ids:
            raise Dsv41Error("the prompt is empty")
        if max_tokens < 0:
            raise Dsv41Error("max_tokens must be >= 0")
        for t in prompt_ids:
            if not 0 <= int(t) < VOCAB_SIZE:
                raise Dsv41Error(f"token id {t} is outside [0, {VOCAB_SIZE})")
        total = len(prompt_ids) + max_tokens
        if total > self.cfg.max_position_embeddings:
            raise Dsv41Error(f"{total} tokens exceed max_position_embeddings {self.cfg.max_position_embeddings}")
        cache = self.model.new_cache(total)
        taps, out = [], []
        ids = [int(t) for t in prompt_ids]
        last = None
        for a in range(0, len(ids), chunk):
            part = ids[a : a + chunk]
            fo = self.model.forward([(cache, part)], [list(range(len(part)))])
            taps.append(fo.taps[0])
            last = fo.logits[0][-1]
        for _i in range(max_tokens):
            tok = int(torch.argmax(last))
            out.append(tok)
            fo = self.model.forward([(cache, [tok])], [[0]])
            taps.append(fo.taps[0])
            last = fo.logits[0][0]
        return GenerateResult(tokens=out, hidden_tap=torch.cat(taps).numpy().astype(np.float32))
