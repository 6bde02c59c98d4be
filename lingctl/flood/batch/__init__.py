"""Batch files: OpenAI-format requests in, results, errors and a manifest out, resumable (``flood run``)."""
