"""Getting a model directory: name resolution, the default model, GGUF conversion.

The engine takes a resolved directory; callers (the offline API, workers, the CLI, benchmarks)
resolve names here first.
"""
