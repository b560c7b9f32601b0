"""`kvsplice bench core`: the reuse engine's core operations on one segment, timed."""
