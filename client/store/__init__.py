"""The worker's side of the store: gRPC and same-host clients, wire mapping, local tier, puts."""
