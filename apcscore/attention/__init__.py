"""Attention over the paged KV cache: batch metadata, and the backends (torch, Triton)."""
