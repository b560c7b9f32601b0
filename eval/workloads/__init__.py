"""Workloads: problems, agent roles and scoring for each task set (synthetic, HumanEval, math, mc)."""
