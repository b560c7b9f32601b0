"""kvsplice.common."""
