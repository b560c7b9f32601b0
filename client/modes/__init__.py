"""Reuse modes: one module per mode (one folder for anchor), `registry` names them, `admission` gates them."""
