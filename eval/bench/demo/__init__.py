"""`kvsplice demo`: the multi-agent demo, its judge and its tables."""
