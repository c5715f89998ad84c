"""The generator service: an async generation engine (vLLM's AsyncLLM, or a small transformers
fallback) behind an OpenAI-compatible HTTP API with the token-level extensions RL needs, plus
admin routes (pause, resume, load weights, reset prefix cache, state) and a weight watcher that
follows the run's ``weights`` stream. Started with ``python -m services.generator --config FILE``.
"""
