"""Observation: what a step did and how long it took (timing, stats, trace, report, monitor, memory).

The engine records into these; nothing here imports the engine.
"""
