"""`kvsplice bench judge`: judges over candidate sets in each mode, against the dense judge."""
