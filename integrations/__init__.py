"""Engines kvsplice plugs into (each in a subpackage that imports its engine)."""
