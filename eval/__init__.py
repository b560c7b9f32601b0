"""kvsplice.eval."""
