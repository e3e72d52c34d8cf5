"""Load the Engram keys of a model config (flat, or nested under ``text_config``).

Key names follow the public DeepSeek-V4.1-Flash config (engram-spec.md section 1).  The flat
inference config spells the pad key ``engram_pad_id``; it is accepted as an alias of
``engram_pad_token_id``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsv41.errors import ConfigError

#: Keys every Engram config must carry.
REQUIRED_KEYS = (
    "engram_layer_ids",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
)

#: One UE8M0 scale byte per this many FP8 values (engram-spec.md section 4).
SCALE_BLOCK = 32

#: Plausibility bounds (V4.1-Flash: 4, 8, 256, 16,000,000, 99,092, layers 1 and 14).  They keep
#: a typo from hanging the prime search or overflowing the int64 hash / u32 wire fields.
MAX_NGRAM_SIZE = 16
MAX_HEADS = 256
MAX_HEAD_DIM = 8192
MAX_VOCAB_SIZE = 1 << 32
MAX_COMPRESSED_VOCAB = 1 << 31
MAX_LAYER_ID = 1 << 16


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_model_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> dict:
    """Return a flat dict of the config with the Engram keys validated.

    ``path_or_dict`` is a JSON file path or an already-parsed mapping.  When the mapping has a
    ``text_config`` object its keys override the top-level ones (HF multimodal layout).  The
    returned dict always has ``engram_pad_token_id`` (alias ``engram_pad_id`` folded in) and
    ``engram_compressed_vocab_size`` (defaults to ``vocab_size``: small synthetic configs use an
    identity token map).

    Raises :class:`ConfigError` for an unreadable file, bad JSON, missing keys, wrong types,
    values outside the plausibility bounds above (``MAX_*``), or inconsistent values (e.g.
    ``engram_num_embeddings`` not one per layer).
    """
    if isinstance(path_or_dict, Mapping):
        raw: Any = dict(path_or_dict)
        where = "config"
    else:
        p = Path(path_or_dict)
        where = str(p)
        from dsv41 import fileio

        text = fileio.read_text(p, "model config", error=ConfigError)
        try:
            raw = fileio.loads_json(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config {p} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model config {where} must be a JSON object")
    cfg = dict(raw)
    text_cfg = raw.get("text_config")
    if text_cfg is not None:
        if not isinstance(text_cfg, dict):
            raise ConfigError(f"model config {where}: text_config must be an object")
        cfg.update(text_cfg)
    if "engram_pad_token_id" not in cfg and "engram_pad_id" in cfg:
        cfg["engram_pad_token_id"] = cfg["engram_pad_id"]
    elif "engram_pad_id" in cfg and cfg["engram_pad_id"] != cfg["engram_pad_token_id"]:
        raise ConfigError(
            f"model config {where}: engram_pad_id={cfg['engram_pad_id']} differs from "
            f"engram_pad_token_id={cfg['engram_pad_token_id']}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ConfigError(f"model config {where} lacks Engram keys: {', '.join(missing)}")

    layers = cfg["engram_layer_ids"]
    if not (isinstance(layers, list) and layers and all(_is_int(x) and x >= 0 for x in layers)):
        raise ConfigError(f"model config {where}: engram_layer_ids must be a non-empty list of ints >= 0")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"model config {where}: engram_layer_ids has duplicates: {layers}")
    for k in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_pad_token_id"):
        if not _is_int(cfg[k]) or cfg[k] < 0:
            raise ConfigError(f"model config {where}: {k} must be an int >= 0, got {cfg[k]!r}")
    if max(layers) >= MAX_LAYER_ID:
        raise ConfigError(f"model config {where}: engram_layer_ids must be < {MAX_LAYER_ID}, got {max(layers)}")
    if not 2 <= cfg["engram_max_ngram_size"] <= MAX_NGRAM_SIZE:
        raise ConfigError(f"model config {where}: engram_max_ngram_size must be in [2, {MAX_NGRAM_SIZE}]")
    if not 1 <= cfg["engram_n_heads"] <= MAX_HEADS:
        raise ConfigError(f"model config {where}: engram_n_heads must be in [1, {MAX_HEADS}]")
    hd = cfg["engram_head_dim"]
    if hd < SCALE_BLOCK or hd % SCALE_BLOCK or hd > MAX_HEAD_DIM:
        raise ConfigError(
            f"model config {where}: engram_head_dim {hd} must be a positive multiple of {SCALE_BLOCK} <= {MAX_HEAD_DIM}"
        )
    vs = cfg["engram_vocab_size"]
    n_orders = cfg["engram_max_ngram_size"] - 1
    if _is_int(vs):
        vs_list = [vs] * n_orders
    elif isinstance(vs, list) and len(vs) == n_orders and all(_is_int(x) for x in vs):
        vs_list = list(vs)
    else:
        raise ConfigError(f"model config {where}: engram_vocab_size must be an int or a list of {n_orders} ints")
    if min(vs_list) < 2 or max(vs_list) > MAX_VOCAB_SIZE:
        raise ConfigError(f"model config {where}: engram_vocab_size must be in [2, 2^32]")
    cfg["engram_vocab_sizes"] = vs_list
    if "engram_compressed_vocab_size" not in cfg:
        if "vocab_size" not in cfg:
            raise ConfigError(
                f"model config {where} lacks engram_compressed_vocab_size (and vocab_size to default it to)"
            )
        cfg["engram_compressed_vocab_size"] = cfg["vocab_size"]
    cvs = cfg["engram_compressed_vocab_size"]
    if not _is_int(cvs) or not 1 <= cvs <= MAX_COMPRESSED_VOCAB:
        raise ConfigError(
            f"model config {where}: engram_compressed_vocab_size must be an int in [1, 2^31], got {cvs!r}"
        )
    ne = cfg.get("engram_num_embeddings")
    if ne is not None:
        if _is_int(ne):
            ne = [ne]
        if not (isinstance(ne, list) and len(ne) == len(layers) and all(_is_int(x) and x > 0 for x in ne)):
            raise ConfigError(
                f"model config {where}: engram_num_embeddings must list one positive int per "
                f"Engram layer ({len(layers)}), got {cfg.get('engram_num_embeddings')!r}"
            )
        cfg["engram_num_embeddings"] = ne
    return cfg
