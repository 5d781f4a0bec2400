"""The step model: a training step of the wrapped model predicted on a virtual clock.

`cost` (links and the alpha-beta ring times, a unit's costs), `simulate` (the engine's own
`Schedule` replayed on a fluid clock), `calibration` (the measured terms the simulator runs on,
their files and defaults; `fitting` holds the arithmetic that fits them), `tuning` (the knobs, measurements
and proposals autotune and the model share) and `online` (the model fitted to a run's first
steps, which autotune proposes with). `overlap plan` and `overlap tune` build on it.

It replays `overlap.engine.schedule` (pure: no tensors) and is imported by the engine's autotune;
it imports nothing from `overlap.tools` nor from autotune. Nothing is imported here, so
`import overlap.step_model.cost` stays light.
"""
