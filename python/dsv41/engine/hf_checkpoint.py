"""A tiny Hugging Face Llama checkpoint for the vLLM lab: real vLLM serves it on CPU.

No DeepSeek-V4.1 model can be built by vLLM's CPU build (its attention and Engram are CUDA-only),
so the lab's real-vLLM variant (docs/lab.md, "The vLLM lab") serves the stock plumbing with a
model vLLM's CPU runner supports: ``LlamaForCausalLM`` with 2 layers, hidden 128, 4 heads / 2 KV
heads, and a byte-level BPE tokenizer of the 256 byte symbols (no merges) plus ``<|bos|>`` and
``<|eos|>``. Everything is a pure function of ``seed``: the same directory, byte for byte, on every
controller (weights from a seeded ``torch.Generator``, normal(0, 0.02), bf16; norms 1.0), so the
target identity (:func:`identity`) and the six greedy references are stable across rebuilds.

Files written under ``out``: ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``. Formats: transformers' ``LlamaConfig`` and
``PreTrainedTokenizerFast`` (tokenizers' ``tokenizer.json``: BPE model, ByteLevel pre-tokenizer and
decoder), safetensors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error

VOCAB = 320  # 256 byte symbols + 2 specials, padded to a multiple of 64
BOS, EOS = 256, 257
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2
MAX_POSITIONS = 512
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes 0..255, in byte order (GPT-2's
    table: printable Latin-1 bytes map to themselves, the others to U+0100 upward)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def config() -> dict:
    """transformers' config of the checkpoint (``LlamaForCausalLM``, bf16)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
    }


def tokenizer() -> dict:
    """``tokenizer.json``: byte-level BPE over the 256 byte symbols (ids 0..255), no merges, and the
    two special tokens (``BOS``, ``EOS``)."""
    specials = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, c in ((BOS, "<|bos|>"), (EOS, "<|eos|>"))
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {s: i for i, s in enumerate(byte_symbols())},
            "merges": [],
        },
    }


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` (``PreTrainedTokenizerFast``, a plain chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def tensors(seed: int) -> dict:
    """The weights by their Llama names, bf16 torch tensors: every matrix normal(0, 0.02) from one
    ``torch.Generator`` seeded with ``seed``, drawn in name order; every RMSNorm weight 1.0."""
    import torch

    head = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    norms = ["model.norm.weight"]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * head, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
        norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    gen = torch.Generator().manual_seed(seed)
    out = {
        name: (torch.randn(shapes[name], generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        for name in sorted(shapes)
    }
    out |= {name: torch.ones(HIDDEN, dtype=torch.bfloat16) for name in norms}
    return out


def write(out: Path, seed: int) -> str:
    """Write the checkpoint into directory ``out`` (created; each file replaced atomically) and
    return its :func:`identity`. Raises Dsv41Error (through fileio) when ``out`` cannot be written."""
    from safetensors.torch import save as save_safetensors

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Dsv41Error(f"checkpoint directory {out}: {exc.strerror}") from None
    fileio.atomic_write_json(out / "config.json", config(), "config.json")
    fileio.atomic_write_json(
        out / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS}, "generation_config.json"
    )
    fileio.atomic_write_json(out / "tokenizer.json", tokenizer(), "tokenizer.json")
    fileio.atomic_write_json(out / "tokenizer_config.json", tokenizer_config(), "tokenizer_config.json")
    fileio.atomic_write(
        out / "model.safetensors", save_safetensors(tensors(seed), {"format": "pt"}), "model.safetensors"
    )
    return identity(out)


def identity(directory: Path) -> str:
    """sha256 over the checkpoint's files (:data:`FILES`, each as name, NUL, sha256 of its bytes,
    newline): the target identity of the vLLM lab. Raises Dsv41Error naming a missing file."""
    h = hashlib.sha256()
    for name in FILES:
        h.update(f"{name}\0{hashlib.sha256(fileio.read_bytes(Path(directory) / name, name)).hexdigest()}\n".encode())
    return h.hexdigest()
