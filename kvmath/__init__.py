"""kvsplice.kvmath."""
