"""Benchmark harness: run.py (sweep, tables, CSV/JSON/PNG), baselines.py (competitors), report.py (tables)."""
