"""kvsplice.agents."""
