"""The vLLM lab's tiny Llama checkpoint (dsv41.engine.hf_checkpoint): deterministic, loadable shapes."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from dsv41.cli import main as cli_main
from dsv41.engine import hf_checkpoint as hf
from dsv41.errors import Dsv41Error


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return d, hf.write(d / "a", 41)


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(written, tmp_path):
    d, ident = written
    assert hf.write(tmp_path / "b", 41) == ident == hf.identity(d / "a")
    for name in hf.FILES:
        assert (tmp_path / "b" / name).read_bytes() == (d / "a" / name).read_bytes(), name
    assert hf.write(tmp_path / "c", 42) != ident


def test_weights_have_every_llama_tensor_at_its_shape_in_bf16(written):
    d, _ = written
    cfg = json.loads((d / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    with safe_open(d / "a" / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert shapes["model.embed_tokens.weight"] == (cfg["vocab_size"], cfg["hidden_size"])
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (cfg["num_key_value_heads"] * head, cfg["hidden_size"])
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (cfg["hidden_size"], cfg["intermediate_size"])
    assert len(shapes) == 3 + cfg["num_hidden_layers"] * 9


def test_the_tokenizer_maps_each_byte_to_one_symbol_and_the_specials_fit_the_vocab(written):
    d, _ = written
    tok = json.loads((d / "a" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert len(vocab) == 256 and sorted(vocab.values()) == list(range(256))
    assert len(set(hf.byte_symbols())) == 256 and hf.byte_symbols()[ord("A")] == "A"
    ids = [t["id"] for t in tok["added_tokens"]]
    assert ids == [hf.BOS, hf.EOS] and max(ids) < hf.config()["vocab_size"]


def test_identity_of_a_directory_without_a_file_is_one_error(tmp_path):
    with pytest.raises(Dsv41Error, match="config.json"):
        hf.identity(tmp_path)


def test_cli_writes_and_names_the_identity(tmp_path, capsys):
    assert cli_main(["engine", "hf-checkpoint", "--out", str(tmp_path / "x"), "--seed", "7"]) == 0
    ident = capsys.readouterr().out.strip()
    assert cli_main(["engine", "hf-checkpoint-identity", str(tmp_path / "x")]) == 0
    assert capsys.readouterr().out.strip() == ident and len(ident) == 64
    assert cli_main(["engine", "hf-checkpoint-identity", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
