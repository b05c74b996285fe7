"""`glance-serve`: the OpenAI-compatible HTTP server over one runner (torch-free; the `serve` extra)."""
