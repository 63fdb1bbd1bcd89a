"""What `capo setup` turns PyPI wheels into: embedded models (``models``), training prompt
tables (``prompts``) and held-out benchmarks (``benchmarks``)."""
