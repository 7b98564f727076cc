"""Attention over the paged KV pool and the Triton kernels: what runs on the device per layer."""
