"""Measurements of our own commands, with no peer beside them: the data pipeline's speed, the
training budget under load, the architecture switches, the held-out bits/byte two ways,
quantization's perplexity and the CPU training step's kernels.

Run one as `python -m picollama.lab.measure.NAME`. What they share with the benchmarks against
peers comes from picollama.lab.bench.common."""
