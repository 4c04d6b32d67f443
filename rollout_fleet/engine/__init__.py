"""The built-in engine: a torch generator with continuous batching that speaks SGLang 0.5.23's HTTP protocol.

- ``protocol``: request parsing / validation and response building (pure, no HTTP);
- ``sampler``: batched sampling and the log-probs SGLang returns;
- ``runner``: prefill / decode over the HF model's modules with a row-slotted KV cache;
- ``scheduler``: the engine thread (continuous batching, aborts, pause modes);
- ``core``: ``Engine``, the model + scheduler facade (weights in, version labels);
- ``server``: the aiohttp app, ``serve`` and ``ServerThread``;
- ``main``: ``run_engine(shared, engine)`` and ``python -m rollout_fleet.engine``.
"""
