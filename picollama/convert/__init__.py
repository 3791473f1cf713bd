"""`python -m picollama.convert`: a run to and from Hugging Face's Llama (hf.py) and llama.cpp's
GGUF (to_gguf.py, from_gguf.py), and the cache of imported files (cache.py)."""
