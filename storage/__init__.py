"""kvsplice.storage."""
