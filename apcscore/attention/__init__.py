"""Attention over the paged KV cache: batch metadata, and the backends (torch, Triton)."""

from apcscore.attention.metadata import AttentionMetadata, get_attention_metadata, set_attention_metadata

__all__ = ["AttentionMetadata", "get_attention_metadata", "set_attention_metadata"]
