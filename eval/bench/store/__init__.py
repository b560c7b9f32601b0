"""`kvsplice bench store`: the sidecar's put and get paths, lookups and reads, timed."""
