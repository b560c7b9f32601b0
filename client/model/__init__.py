"""The model the worker runs: loading, fingerprint, chat template, transformers' cache and decoder layers."""
