"""Models: finding a model's files (locate, the GGUF conversion cache gguf_cache), loading its parts (loading,
resolved), our own decoder (llama, with architecture and rope), and the compute backend it runs on (backend)."""
