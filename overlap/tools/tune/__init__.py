"""`overlap tune`: measured tuning of `OverlapConfig` on the real world, pruned by the planner.

    from overlap.tools.tune import tune
    result = tune(model_fn, step_fn, out="tuned.json")      # on every rank
    model = overlap.wrap(model_fn(), config=result.config)  # or OverlapConfig.load("tuned.json")

Search space (`TuneSpace`), successive halving (`halving`), the planner's pruning (`predict`),
measured trials and rank 0's decisions (`measure`), the cache (`cache`), the options
(`options`: TuneConfig), the result (`result`: TuneResult, RoundResult), the orchestrator (`tuner`)
and the command line (`command`) live in their own modules.
"""

from overlap.tools.tune.halving import HalvingRound, halving_schedule, score, survivors
from overlap.tools.tune.options import TuneConfig
from overlap.tools.tune.result import RoundResult, TuneResult
from overlap.tools.tune.space import Codec, TuneSpace, default_space, describe
from overlap.tools.tune.tuner import default_optimizer, tune

__all__ = [
    "Codec",
    "HalvingRound",
    "RoundResult",
    "TuneConfig",
    "TuneResult",
    "TuneSpace",
    "default_optimizer",
    "default_space",
    "describe",
    "halving_schedule",
    "score",
    "survivors",
    "tune",
]
