"""Generating tokens: sampling and penalties, the prompt cache, plain decoding (`decode`), the
token loop every request runs (`loop`: stops, streaming, statistics) and its profiler."""
