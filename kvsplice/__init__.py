"""kvsplice: KV-cache segment reuse for multi-agent LLM inference."""

__version__ = "0.1.0"
