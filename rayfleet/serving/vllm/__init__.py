"""vLLM as a rayfleet serving engine, through Ray Serve LLM (``engine: vllm`` in a serve spec).

- ``config``: the spec -> Serve LLM arguments (pure; unit-tested without Ray or vLLM).
- ``app``: builds the Serve application; ``serve deploy`` import path.
- ``metrics``: vLLM's own metrics as Ray's Prometheus exports them.
- ``tiny_model``: a tiny Qwen3-MoE written locally (tests, benchmarks, demos).
"""
