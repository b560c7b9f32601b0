"""kvsplice.index."""
