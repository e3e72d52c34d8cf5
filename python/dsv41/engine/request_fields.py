"""What the lab engine does with every field of the OpenAI and vLLM request schemas.

No field is silently ignored: each field of ``/v1/completions`` and ``/v1/chat/completions``
(OpenAI's ``CompletionCreateParams`` of the pinned ``openai`` package, vLLM's
``CompletionRequest``/``ChatCompletionRequest``: ``dsv41/data/vllm_request_fields.json``) is

- ``implemented``: parsed and honoured by the server (``dsv41.engine.protocol``) or the sampler;
- ``metadata``: accepted (type-checked), with no effect on the output by the field's own
  definition (an end-user id, a routing/session hint);
- otherwise ``refused``: a 400 naming the field for any value other than the ones that ask for
  nothing (``nothing``: the field's "off" values, compared by type so ``0`` never passes as
  ``false``; null always asks for nothing).

A field in neither schema is refused too (vLLM only logs such fields and drops them).
``check(body, chat)`` applies the table; docs/engine.md, "Request fields", lists it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv41 import fileio

VLLM_FIELDS_FILE = Path(__file__).resolve().parent.parent / "data" / "vllm_request_fields.json"


@dataclass(frozen=True)
class Field:
    """``kind``: ``implemented``, ``metadata`` or ``refused``; ``nothing``: values of a refused
    field that ask for nothing (accepted); ``types``: JSON types a metadata field accepts;
    ``why``: what the engine lacks (the 400's reason) or how it implements the field."""

    kind: str
    nothing: tuple = ()
    types: tuple = ()
    why: str = ""


def _impl(why: str) -> Field:
    return Field("implemented", why=why)


def _meta(why: str, *types) -> Field:
    return Field("metadata", types=types or (str,), why=why)


def _refuse(why: str, *nothing) -> Field:
    return Field("refused", nothing=nothing, why=why)


_COMMON: dict[str, Field] = {
    "model": _impl("must name the served model (404 otherwise)"),
    "max_tokens": _impl("tokens to generate"),
    "n": _impl("1 only (one choice); other values 400"),
    "seed": _impl("per-request torch.Generator seed"),
    "stream": _impl("SSE, one chunk per engine step"),
    "stream_options": _impl("include_usage, continuous_usage_stats"),
    "temperature": _impl("softmax temperature; < 1e-5 greedy"),
    "top_p": _impl("nucleus truncation"),
    "top_k": _impl("top-k truncation (0/-1 off; 1 = greedy)"),
    "min_p": _impl("min-p truncation (0 off)"),
    "ignore_eos": _impl("EOS masked"),
    "min_tokens": _impl("EOS masked before min_tokens"),
    "return_token_ids": _impl("token_ids (and prompt_token_ids) in the choice"),
    "cache_salt": _impl(
        "validated (1-1024 characters); the lab engine has no prefix cache to share, so "
        "requests are isolated whatever the salt"
    ),
    "skip_special_tokens": _refuse("special tokens are always skipped in the text", True),
    "user": _meta("end-user id (abuse monitoring): no effect on the output"),
    "session_id": _meta("session routing hint: no effect on the output"),
    "frequency_penalty": _refuse("no frequency penalty", 0, 0.0),
    "presence_penalty": _refuse("no presence penalty", 0, 0.0),
    "repetition_penalty": _refuse("no repetition penalty", 1, 1.0),
    "logit_bias": _refuse("no logit bias", {}),
    "stop": _refuse("no stop strings (EOS and max_tokens end a request)", [], ""),
    "stop_token_ids": _refuse("no stop token ids besides EOS", []),
    "include_stop_str_in_output": _refuse("no stop strings, so nothing to include", False),
    "bad_words": _refuse("no bad-words filter", []),
    "allowed_token_ids": _refuse("no allowed-token mask"),
    "use_beam_search": _refuse("no beam search", False),
    "length_penalty": _refuse("no beam search (length_penalty applies to it)", 1, 1.0),
    "watermarking": _refuse("no watermarking", False),
    "spaces_between_special_tokens": _refuse("special tokens are skipped, so no spaces between them", True),
    "truncate_prompt_tokens": _refuse("prompts are never truncated (too long: 400)"),
    "truncation_side": _refuse("prompts are never truncated"),
    "prompt_logprobs": _refuse("no logprobs"),
    "logprob_token_ids": _refuse("no logprobs"),
    "return_tokens_as_token_ids": _refuse("no logprobs, whose tokens it formats", False),
    "response_format": _refuse("no structured output", {"type": "text"}),
    "structured_outputs": _refuse("no structured output"),
    "priority": _refuse("first-come scheduling only", 0),
    "request_id": _refuse("the engine names its requests itself"),
    "routed_experts_prompt_start": _refuse("no routed-expert data", 0),
    "return_token_offsets": _refuse("no render endpoint (offsets are only rendered there)", False),
    "return_mm_kwargs": _refuse("no render endpoint and no multimodal input", True),
    "kv_transfer_params": _refuse("no disaggregated serving"),
    "ec_transfer_params": _refuse("no encoder-cache disaggregation"),
    "vllm_xargs": _refuse("no custom extensions"),
    "repetition_detection": _refuse("no repetition detection"),
    "thinking_token_budget": _refuse("the lab model does not reason", -1),
    "stream_interval": _refuse("one chunk per engine step (stream_interval 1)", 1),
}

COMPLETION: dict[str, Field] = {
    **_COMMON,
    "prompt": _impl("text or token ids"),
    "best_of": _impl("1 only; other values 400"),
    "echo": _refuse("no prompt echo", False),
    "logprobs": _refuse("no logprobs"),
    "suffix": _refuse("no fill-in-the-middle"),
    "prompt_embeds": _refuse("no prompt embeddings"),
    "add_special_tokens": _refuse("a completion prompt is tokenized without special tokens", False),
}

CHAT: dict[str, Field] = {
    **_COMMON,
    "messages": _impl("the lab chat template (dsv41.tokenizer.chat_prompt)"),
    "max_completion_tokens": _impl("tokens to generate (over max_tokens)"),
    "metadata": _meta("stored-completion tags: no effect on the output", dict),
    "safety_identifier": _meta("end-user id (abuse monitoring): no effect on the output"),
    "prompt_cache_key": _meta("prompt-cache routing hint: no effect on the output"),
    "logprobs": _refuse("no logprobs", False),
    "top_logprobs": _refuse("no logprobs"),
    "tools": _refuse("no tool calling", []),
    "tool_choice": _refuse("no tool calling", "none"),
    "parallel_tool_calls": _refuse("no tool calling, so nothing to parallelise", True, False),
    "functions": _refuse("no function calling", []),
    "function_call": _refuse("no function calling", "none"),
    "reasoning_effort": _refuse("the lab model does not reason"),
    "include_reasoning": _refuse("the lab model does not reason, so there is nothing to include", True, False),
    "audio": _refuse("no audio output"),
    "modalities": _refuse("text output only", ["text"]),
    "moderation": _refuse("no moderation"),
    "prediction": _refuse("no predicted outputs"),
    "prompt_cache_options": _refuse("no prompt cache"),
    "prompt_cache_retention": _refuse("no prompt cache"),
    "service_tier": _refuse("one service tier", "auto", "default"),
    "store": _refuse("completions are not stored", False),
    "verbosity": _refuse("no verbosity control"),
    "web_search_options": _refuse("no web search"),
    "echo": _refuse("no echo of the last message", False),
    "add_generation_prompt": _refuse("the lab template always ends with the assistant prompt", True),
    "continue_final_message": _refuse("the lab template always starts a new assistant message", False),
    "add_special_tokens": _refuse("the lab template adds its own special tokens only", False),
    "documents": _refuse("no retrieval documents in the lab template"),
    "chat_template": _refuse("one fixed lab chat template"),
    "chat_template_kwargs": _refuse("one fixed lab chat template", {}),
    "media_io_kwargs": _refuse("no multimodal input"),
    "mm_processor_kwargs": _refuse("no multimodal input"),
    "return_prompt_text": _refuse("no rendered prompt text in the response", False),
}


def table(chat: bool) -> dict[str, Field]:
    """The policy of every field of one endpoint (``chat``: ``/v1/chat/completions``)."""
    return CHAT if chat else COMPLETION


def vllm_fields() -> dict:
    """The stored vLLM field lists (``{"completion": [...], "chat": [...], "source": {...}}``)."""
    return fileio.loads_json(VLLM_FIELDS_FILE.read_text(encoding="utf-8"))


def _same(v: Any, o: Any) -> bool:
    return type(v) is type(o) and v == o


def check(body: dict, chat: bool, show=repr) -> tuple[str, str] | None:
    """The first field of ``body`` the engine refuses, as ``(field, message)``; None when every
    field is implemented, metadata of the right type, or asks for nothing. ``show(value)``
    renders a value in the message (the server passes its bounded ``_show``)."""
    pol = table(chat)
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for key, v in body.items():
        f = pol.get(key)
        if f is None:
            return key, (
                f"{key} is not a field of {endpoint} (OpenAI's or vLLM's request schema); "
                "the lab engine refuses fields it would otherwise ignore"
            )
        if f.kind == "implemented" or v is None:
            continue
        if f.kind == "metadata":
            if isinstance(v, bool) or not isinstance(v, f.types):
                names = " or ".join({str: "a string", dict: "an object"}.get(t, t.__name__) for t in f.types)
                return key, f"{key} must be {names}, got {show(v)}"
            continue
        if any(_same(v, o) for o in f.nothing):
            continue
        return key, f"{key} is not supported by the lab engine ({f.why}; got {show(v)})"
    return None
