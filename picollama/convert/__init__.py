"""`python -m picollama.convert` moves a run to and from other formats.

Hugging Face's Llama format is in hf.py. The GGUF format of llama.cpp is in to_gguf.py and
from_gguf.py. The cache of files that --run imported is in cache.py."""
