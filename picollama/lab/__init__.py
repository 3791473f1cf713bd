"""The lab holds the length-extrapolation study and the benchmarks.

The study covers perplexity, retrieval and the one-command study. The core never imports the
lab. Only `generate.py extrapolate` and `generate.py study` enter it."""
