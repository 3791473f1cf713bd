"""Benchmarks against Hugging Face's Llama and llama.cpp: `python -m picollama.lab.bench.NAME`, and
what they share (common, decode_report, llama_cpp_runner)."""
