"""Eval-test fixtures live in eval_factories; this file puts tests/eval on sys.path for the subfolders."""
