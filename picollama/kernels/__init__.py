"""One fast decode step: a run loaded to sample, its weights quantized, its KV caches, the fused
one-token step and the C++ kernels under it. The step knows nothing of sampling or of text: it
takes token ids and positions and gives logits. sampling/ drives it."""
