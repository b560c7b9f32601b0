"""`kvsplice bench agents` and `bench layouts`: a workload through the agent pipeline per mode variant."""
