"""The lab target model's configuration: :class:`ModelConfig` and :func:`load_config`.

Built on :func:`dsv41.engram.config.load_model_config` (which reads the JSON, folds
``text_config`` in and validates the Engram keys, engram-spec.md section 1), so the config is read
and flattened once; this module adds the model keys and the lab's own constraints (byte
tokenizer vocabulary, TP shards, tap layer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsv41.engram.config import load_model_config
from dsv41.errors import ConfigError
from dsv41.tokenizer import TOKEN_MAP, VOCAB_SIZE

_REQUIRED = [
    "seed",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hc_mult",
    "rms_norm_eps",
    "max_position_embeddings",
    "engram_layer_ids",
    "drafter_tap_layer",
]
ENGRAM_COLUMNS = 24  # 3 orders x 8 heads (engram-spec.md section 2)
ENGRAM_HEAD_DIM = 256


@dataclass
class ModelConfig:
    """Model keys of ``lab_model.json`` (engram keys are read by ``dsv41.engram``).

    ``raw`` keeps the whole JSON dict (what ``EngramLayout.from_config`` takes).
    """

    seed: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hc_mult: int
    rms_norm_eps: float
    max_position_embeddings: int
    engram_layer_ids: list[int]
    drafter_tap_layer: int
    rope_theta: float = 10000.0
    tp_shards: int = 2
    train_steps: int = 200
    train_batch: int = 16
    train_seq_len: int = 64
    train_lr: float = 4e-3
    engram_wkv_std: float = 5e-7
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        """Per-head width: hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @property
    def engram_dim(self) -> int:
        """Engram row width in values: 24 columns x 256 = 6144 (docs/engram-spec.md)."""
        return ENGRAM_COLUMNS * ENGRAM_HEAD_DIM  # 6144


def load_config(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """Read and check the model config.

    Accepts a path to JSON or a dict (flat, or nested under ``text_config``). The file is read,
    flattened and its Engram keys checked once, by :func:`dsv41.engram.config.load_model_config`;
    ``ModelConfig.raw`` keeps that flat dict (what ``EngramLayout.from_config`` and the drafter
    checks take). Raises ``ConfigError`` naming the missing or inconsistent key.
    """
    raw = load_model_config(path_or_dict)
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"model config lacks keys: {', '.join(missing)}")
    kw = {k: raw[k] for k in ModelConfig.__dataclass_fields__ if k in raw and k != "raw"}
    try:
        cfg = ModelConfig(**kw, raw=raw)
    except TypeError as exc:
        raise ConfigError(f"model config: {exc}") from None
    if cfg.vocab_size != VOCAB_SIZE:
        raise ConfigError(f"vocab_size must be {VOCAB_SIZE} (byte tokenizer), got {cfg.vocab_size}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError("hidden_size must be divisible by num_attention_heads")
    if cfg.head_dim % 2:
        raise ConfigError("head_dim must be even (RoPE)")
    if cfg.num_attention_heads % cfg.tp_shards or cfg.intermediate_size % cfg.tp_shards:
        raise ConfigError("num_attention_heads and intermediate_size must be divisible by tp_shards")
    if not 0 <= cfg.drafter_tap_layer < cfg.num_hidden_layers:
        raise ConfigError("drafter_tap_layer must name a layer in [0, num_hidden_layers)")
    for lid in cfg.engram_layer_ids:
        if not 0 <= lid < cfg.num_hidden_layers:
            raise ConfigError(f"engram layer {lid} is outside [0, num_hidden_layers)")
    if int(raw.get("engram_pad_token_id", 2)) != int(TOKEN_MAP[2]):
        raise ConfigError("engram_pad_token_id must be 2 (the tokenizer's pad id)")
    return cfg
