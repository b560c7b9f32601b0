"""The shared-tier bench: sidecar processes on a loopback Redis Cluster, faults injected."""
