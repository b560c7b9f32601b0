"""kvsplice.client."""
