"""The local stand-in for the serving image: a small DSV41-shaped decoder with the real Engram
data path, tensor parallel over torch.distributed, and an OpenAI-compatible HTTP server.

Modules: ``tokenizer`` (byte tokenizer + compressing token map), ``model`` (weights, forward,
KV cache, Engram gate), ``tp`` (process group / collectives), ``spec`` (speculation hook and
verification), ``scheduler`` (continuous batching), ``engine`` (the step loop over ranks),
``runner`` (single-process TP1 API), ``metrics``, ``server`` (FastAPI app), ``cli``.
See docs/engine.md.
"""
