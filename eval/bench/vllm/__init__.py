"""`kvsplice bench vllm` and its admission: vLLM engines with kvsplice, LMCache and no connector."""
