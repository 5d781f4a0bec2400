"""The GPU checks' shared pieces: models and steps, the comparison, the runtime's copy layouts,
the numerics cases, the spawned worlds, the bandwidth rows and the JSON report."""
