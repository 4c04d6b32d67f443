"""The built-in engine: a torch generator with continuous batching that speaks SGLang 0.5.23's HTTP protocol.

- ``protocol``: request parsing / validation and response building (pure, no HTTP);
- ``sampler``: batched sampling and the log-probs SGLang returns;
- ``kv_cache``: the paged KV cache (block pool, block tables, reference counts, the prefix cache);
- ``attention``: decode attention over the paged cache (in place over a block range, or gathered);
- ``runner``: prefill (in chunks, after a cached prefix) and decode over the HF model's modules;
- ``scheduler``: the engine thread (continuous batching, chunked prefill, KV memory and retraction, aborts,
  pause modes);
- ``core``: ``Engine``, the model + scheduler facade (weights in, version labels);
- ``server``: the aiohttp app, ``serve`` and ``ServerThread``;
- ``main``: ``run_engine(shared, engine)`` and ``python -m rollout_fleet.engine``.
"""
