"""The model on the device: the decoder, its weights, its elementwise ops, CPU-packed matmuls."""
