"""Sampling from a loaded model: the decode loop and its sampler, continuous batching's rows and
slots, prompts, and the terminal chat. generate.py and the server both decode through here. The
steps it calls live in kernels/. Nothing here speaks HTTP."""
