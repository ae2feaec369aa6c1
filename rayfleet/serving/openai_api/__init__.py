"""The OpenAI-compatible HTTP API (``app``) and the served model's Prometheus metrics (``metrics``)."""
