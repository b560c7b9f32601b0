"""Reporting: results files, tables and plots of a run."""
