"""The lab: the length-extrapolation study (perplexity, retrieval, the one-command study) and the
benchmarks. The core never imports it; `generate.py extrapolate` and `generate.py study` enter
it."""
