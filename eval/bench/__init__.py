"""Benchmarks and demos behind the CLI's `bench` and `demo`: a folder per bench (its config,
run, result and files); what several share (mode runner, mode variants, store session) here."""
