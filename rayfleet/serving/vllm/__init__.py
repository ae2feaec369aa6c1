"""vLLM as a rayfleet serving engine, through Ray Serve LLM (``engine: vllm`` in a serve spec).

- ``config``: the spec -> Serve LLM arguments (pure; unit-tested without Ray or vLLM).
- ``app``: builds the Serve application; ``serve deploy`` import path.
- ``prometheus_scrape``: vLLM's own metrics as Ray's Prometheus exports them.
- ``tiny_model``: a tiny Qwen3-MoE written locally (tests, benchmarks, demos).
- ``ingress``, ``server``, ``routing``, ``text_blocks``, ``pool_load``: the ingress with
  rayfleet's API keys, the LLM server that publishes text-block hashes, rayfleet's request
  router over them, and a pool's load for the autoscaler's Serve shell.

A top room of the serving ladder, beside ``openai_api``: it may import ``deploy`` (Serve
autoscaling bounds) and lower rooms; nothing in ``serving`` below ``deployer`` imports it.
"""
