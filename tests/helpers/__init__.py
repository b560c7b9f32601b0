"""Builders shared by the tests (`make_*` factories, fakes, small servers), one module per
topic, imported by name: `from helpers.store import make_meta` (pytest puts tests/ on
sys.path: `pythonpath` in pyproject.toml)."""
