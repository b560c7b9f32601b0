"""kvsplice.server."""
