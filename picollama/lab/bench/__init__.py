"""Benchmarks against Hugging Face's Llama and llama.cpp.

Run one as `python -m picollama.lab.bench.NAME`. The modules common, decode_report and
llamacpp hold what several benchmarks share."""
