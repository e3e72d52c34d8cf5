"""The local stand-in for the serving image: a small DSV41-shaped decoder with the real Engram
data path, tensor parallel over torch.distributed, and an OpenAI-compatible HTTP server.

Modules: ``model_config`` (config), ``weights`` (init, training, save/load, identity),
``layers`` (RoPE, RMSNorm), ``model`` (forward, KV cache, Engram gate), ``tp`` (process group /
collectives), ``spec_decode`` (the speculation hook types, below engine and drafter),
``sampler`` (sampling rules), ``rejection_sampler`` (draft verification), ``scheduler``
(continuous batching), ``engine`` (the step loop over ranks), ``runner`` (single-process TP1
API), ``metrics``, ``server`` (FastAPI app), ``cli`` (engine-only commands; ``serve`` is in
``dsv41.entrypoints.engine_serve``). The byte tokenizer is ``dsv41.tokenizer``. See
docs/engine.md.
"""
