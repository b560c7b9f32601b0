"""`kvsplice bench serve`: vLLM's own clients against OpenAI servers behind one router."""
