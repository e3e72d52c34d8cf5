"""Issue 25 item 7: no request field is silently ignored.

The fields are enumerated from their definitions, not a hand-kept list: the installed ``openai``
package's ``CompletionCreateParams`` TypedDicts (streaming and non-streaming, completions and
chat) and vLLM's ``CompletionRequest``/``ChatCompletionRequest`` (``dsv41/data/
vllm_request_fields.json``, with its source). Every field gets its implemented behaviour, or
a 400 naming it for every value that asks for something (and 200 for the values that ask for
nothing), or (metadata) 200 with the right type and 400 with another. ``top_k: 1`` is greedy.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dsv41.engine import request_fields  # noqa: E402
from dsv41.engine.sampler import SamplingParams, probs_of, sample  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from engineutil import FakeEngine  # noqa: E402


def openai_fields(chat: bool) -> set[str]:
    """Every key of the installed openai package's create-params TypedDicts of the endpoint."""
    if chat:
        from openai.types.chat import completion_create_params as mod
    else:
        from openai.types import completion_create_params as mod
    keys: set[str] = set()
    for name in ("CompletionCreateParamsBase", "CompletionCreateParamsStreaming", "CompletionCreateParamsNonStreaming"):
        td = getattr(mod, name)
        keys |= set(td.__required_keys__) | set(td.__optional_keys__)
    return keys


def schema_fields(chat: bool) -> set[str]:
    return openai_fields(chat) | set(request_fields.vllm_fields()["chat" if chat else "completion"])


def _call(body: dict, chat: bool):
    eng = FakeEngine()
    c = TestClient(create_app(eng, "m", 64), raise_server_exceptions=False)
    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    base["max_tokens"] = 1
    base.update(body)
    r = c.post(
        "/v1/chat/completions" if chat else "/v1/completions",
        content=json.dumps(base),
        headers={"content-type": "application/json"},
    )
    return r, eng


def _probes(f: request_fields.Field) -> list:
    """Values that ask for something: every JSON kind, minus the field's "nothing" values."""
    cands = [1, 2, 0.5, -3, "x", True, False, [1], ["x"], {"a": 1}, {"type": "json_object"}]
    return [v for v in cands if not any(type(v) is type(o) and v == o for o in f.nothing)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_schema_field_has_a_policy_and_no_policy_is_invented(chat):
    fields, pol = schema_fields(chat), request_fields.table(chat)
    assert len(openai_fields(chat)) >= (30 if chat else 17)  # the enumeration really read the package
    assert fields - set(pol) == set(), "fields of the schemas with no policy (silently ignored before)"
    assert set(pol) - fields == set(), "policies for fields in neither schema"


def _cases(kind: str):
    out = []
    for chat in (False, True):
        for name, f in sorted(request_fields.table(chat).items()):
            if f.kind == kind:
                out.append(pytest.param(chat, name, id=f"{'chat' if chat else 'completions'}-{name}"))
    return out


@pytest.mark.parametrize("chat, name", _cases("refused"))
def test_a_refused_field_is_400_naming_it_unless_it_asks_for_nothing(chat, name):
    f = request_fields.table(chat)[name]
    for v in _probes(f):
        r, eng = _call({name: v}, chat)
        assert r.status_code == 400, (name, v, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and err["type"] == "BadRequestError", err
        assert eng.params == []  # nothing reached the engine
    for v in (None, *f.nothing):
        r, _ = _call({name: v}, chat)
        assert r.status_code == 200, (name, v, r.text)


@pytest.mark.parametrize("chat, name", _cases("metadata"))
def test_metadata_fields_are_type_checked_and_change_nothing(chat, name):
    f = request_fields.table(chat)[name]
    good = {"a": "b"} if dict in f.types else "someone-7"
    r, eng = _call({name: good}, chat)
    assert r.status_code == 200, r.text
    plain, eng2 = _call({}, chat)
    assert eng.params == eng2.params and eng.prompts == eng2.prompts  # no effect on what runs
    for bad in (1, True, ["x"], {"a": 1} if str in f.types else "x"):
        r, _ = _call({name: bad}, chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, bad, r.text)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name", ["no_such_field", "best_of_n", "extra_body", "guided_json", "beam_width"])
def test_a_field_of_neither_schema_is_refused(chat, name):
    r, _ = _call({name: 1}, chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == name and "not a field" in r.json()["error"]["message"]


# --- implemented fields: each one's behaviour (the set must equal the table's) ------------------


def _params(body, chat):
    r, eng = _call(body, chat)
    assert r.status_code == 200, r.text
    return eng.params[-1], r, eng


def _chk_model(chat):
    assert _call({"model": "m"}, chat)[0].status_code == 200
    assert _call({"model": "other"}, chat)[0].status_code == 404


def _chk_max_tokens(chat):
    assert _params({"max_tokens": 7}, chat)[0].max_tokens == 7
    assert _call({"max_tokens": -1}, chat)[0].status_code == 400


def _chk_max_completion_tokens(chat):
    assert _params({"max_completion_tokens": 5, "max_tokens": 9}, chat)[0].max_tokens == 5


def _chk_n(chat):
    assert _call({"n": 1}, chat)[0].status_code == 200
    assert _call({"n": 2}, chat)[0].json()["error"]["param"] == "n"


def _chk_best_of(chat):
    assert _call({"best_of": 1}, chat)[0].status_code == 200
    assert _call({"best_of": 3}, chat)[0].json()["error"]["param"] == "best_of"


def _chk_seed(chat):
    assert _params({"seed": 42}, chat)[0].seed == 42


def _chk_stream(chat):
    r, _ = _call({"stream": True}, chat)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def _chk_stream_options(chat):
    r, _ = _call({"stream": True, "stream_options": {"include_usage": True}}, chat)
    assert '"usage": {"prompt_tokens"' in r.text


def _chk_temperature(chat):
    assert _params({"temperature": 0.7}, chat)[0].temperature == 0.7


def _chk_top_p(chat):
    assert _params({"top_p": 0.3}, chat)[0].top_p == 0.3


def _chk_top_k(chat):
    p = _params({"top_k": 1, "temperature": 1.0}, chat)[0]
    assert p.top_k == 1 and p.greedy  # vLLM: top_k 1 is greedy
    assert _params({"top_k": -1}, chat)[0].top_k == 0 and _params({"top_k": 3}, chat)[0].top_k == 3
    assert _call({"top_k": -2}, chat)[0].json()["error"]["param"] == "top_k"


def _chk_min_p(chat):
    assert _params({"min_p": 0.2}, chat)[0].min_p == 0.2
    assert _call({"min_p": 1.5}, chat)[0].json()["error"]["param"] == "min_p"


def _chk_ignore_eos(chat):
    assert _params({"ignore_eos": True}, chat)[0].ignore_eos is True


def _chk_min_tokens(chat):
    assert _params({"min_tokens": 1}, chat)[0].min_tokens == 1


def _chk_return_token_ids(chat):
    r = _params({"return_token_ids": True}, chat)[1]
    assert r.json()["choices"][0]["token_ids"] == [5]


def _chk_cache_salt(chat):
    assert _call({"cache_salt": "s" * 43}, chat)[0].status_code == 200
    for bad in ("", "s" * 1025, 5):
        assert _call({"cache_salt": bad}, chat)[0].json()["error"]["param"] == "cache_salt"


def _chk_prompt(chat):
    assert _params({"prompt": [7, 8]}, chat)[2].prompts[-1] == [7, 8]


def _chk_messages(chat):
    from dsv41.tokenizer import ByteTokenizer

    msgs = [{"role": "user", "content": "hi"}]
    assert _params({"messages": msgs}, chat)[2].prompts[-1] == ByteTokenizer().chat_prompt(msgs)


CHECKS = {
    f.__name__[5:]: f
    for f in (
        _chk_model,
        _chk_max_tokens,
        _chk_max_completion_tokens,
        _chk_n,
        _chk_best_of,
        _chk_seed,
        _chk_stream,
        _chk_stream_options,
        _chk_temperature,
        _chk_top_p,
        _chk_top_k,
        _chk_min_p,
        _chk_ignore_eos,
        _chk_min_tokens,
        _chk_return_token_ids,
        _chk_cache_salt,
        _chk_prompt,
        _chk_messages,
    )
}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_implemented_field_has_its_behaviour_checked(chat):
    impl = {n for n, f in request_fields.table(chat).items() if f.kind == "implemented"}
    assert impl <= set(CHECKS), impl - set(CHECKS)
    for name in sorted(impl):
        CHECKS[name](chat)


# --- the sampler --------------------------------------------------------------------------------


def test_top_k_one_is_the_argmax_and_top_k_min_p_cut_the_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(229, generator=g, dtype=torch.float32)
    top = int(torch.argmax(logits))
    p1 = probs_of(logits, SamplingParams(temperature=1.0, top_k=1))
    assert float(p1[top]) == 1.0 and int((p1 > 0).sum()) == 1
    assert {sample(p1, torch.Generator().manual_seed(s)) for s in range(50)} == {top}
    p5 = probs_of(logits, SamplingParams(temperature=1.0, top_k=5))
    assert int((p5 > 0).sum()) == 5 and set(torch.nonzero(p5).flatten().tolist()) == set(
        torch.topk(logits, 5).indices.tolist()
    )
    assert abs(float(p5.sum()) - 1.0) < 1e-12
    full = probs_of(logits, SamplingParams(temperature=1.0))
    pm = probs_of(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert set(torch.nonzero(pm).flatten().tolist()) == set(torch.nonzero(full >= 0.3 * full.max()).flatten().tolist())
    assert torch.equal(probs_of(logits, SamplingParams(temperature=1.0, top_k=0)), full)
