"""What the engine reports about itself: its Prometheus metrics from EngineStats (`engine_metrics`) and
the last few seconds' observations the dashboard draws (`recent`).

Import the modules directly; this package imports nothing.
"""
