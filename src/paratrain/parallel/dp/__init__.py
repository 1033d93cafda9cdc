"""Data parallelism: spec.py, engine.py (bucketed all-reduce overlapped with backward),
footprint.py and step_time.py (what it costs; ZeRO's and the grid's footprints reuse its buckets)."""
