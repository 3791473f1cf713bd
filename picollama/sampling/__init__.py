"""Sampling from a trained model: loading a run to sample, the KV caches, the fused one-token step
and its C++ kernels, quantization, the decode loop and its sampler, the terminal chat.
generate.py and the server both decode through here. Nothing here speaks HTTP."""
