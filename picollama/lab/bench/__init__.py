"""Benchmarks against Hugging Face's Llama and llama.cpp: `python -m picollama.lab.bench.NAME`."""
