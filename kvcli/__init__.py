"""kvcli: prefill-time KV-cache compression for GGUF models, from the terminal."""
__version__ = "0.1.0"
