"""The engine: `wrap`, the wrapped model's state and hooks, units, the schedule and the runtime.

What it owns (one concern per module): `wrap` (the orchestrator), `state` (what wrap attaches to
a model, and its hooks), `module` (the methods on the wrapped model), `groups` (process groups
from a group or mesh), `checks` (every rank wraps the same model and config), `sharding` (full
parameters to flat shards), `units` (the flat layout), `unit_tensors` (a unit's tensors),
`init` and `sync` (deferred init; rank 0's values to every rank), `schedule` (the state
machine), `runtime` and `reduction` (carry out its actions through a transport),
`guard` (optimizer checks), `deferred` (the checks a step reports late, read before a
checkpoint, an export or exit), `local_step`, `replicated`, `step_hooks`, `teardown`,
`torch_compat` (the private torch APIs it uses, [Note: private torch APIs]). It imports `overlap.transport`, `overlap.observe`,
`overlap.compression` and `overlap.kernels`; nothing below it imports the engine.
"""
