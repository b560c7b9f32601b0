"""kvsplice.proto."""
