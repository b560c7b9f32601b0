"""The HF worker's two tiers: its own local tier and the sidecar, read and written by segment."""
