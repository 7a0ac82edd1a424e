"""Benchmark harness behind `python -m flash4 bench`: run.py (the orchestrator: sweep, GEMM ceiling,
tables, CSV/JSON/PNG), cases.py and varlen.py (cell families timed after the sweep), ablate.py
(--ablate), baselines.py (competitors), report.py (tables, progress, compile check), common.py
(shapes, FLOPs, timer, CSV helpers shared by all; it imports no other bench module)."""
