"""Running a call's plan on the model: plans, executors, the prefill and decode loops."""
