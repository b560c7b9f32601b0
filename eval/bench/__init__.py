"""Benchmarks and demos: running workloads and stores, measured, for the CLI's `bench` and `demo`."""
