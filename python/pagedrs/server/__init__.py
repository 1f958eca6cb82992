"""The OpenAI-compatible HTTP server (``pagedrs serve``)."""
