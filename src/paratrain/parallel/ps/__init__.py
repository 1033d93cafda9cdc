"""Parameter servers: spec.py, engine.py (the strategy), server.py and worker.py (each side of the
protocol), wire.py (how shards travel), footprint.py and step_time.py (what it costs)."""
