"""The store client any engine uses to talk to the sidecar: channel, namespaces, same-host reads, staged puts, faults."""
