"""Applications built on the engine: the CLI and its commands (demo, bench, tune, plan, report),
the launcher, the demo's data and models.

They use `overlap`'s public API and the engine's documented internals; the engine never imports them.
"""
