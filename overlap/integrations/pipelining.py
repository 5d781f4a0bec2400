"""`torch.distributed.pipelining` driving pipeline stages wrapped by `overlap.wrap`.

    from torch.distributed.pipelining import Schedule1F1B
    from overlap.integrations.pipelining import PipelineStage

    module = overlap.wrap(stage_module, group=mesh["dp"])
    stage = PipelineStage(module, stage_index, num_stages, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)

[Note: gradients reduced once per pipeline step]
torch's schedules run each micro-batch's backward through `backward_maybe_with_nosync`, which keeps
FSDP2 and DDP from reducing before the schedule's last backward of the stage (`last_backward`), and
runs any other module's backward as it is: a plain `torch.distributed.pipelining.PipelineStage`
around an overlap-wrapped module reduces every micro-batch's gradients (micro-batches times
FSDP2's data-parallel traffic; the sum of the micro-batches' averages, equal to FSDP2's average of
the sum within rounding). This stage sets the wrapped module's `set_requires_gradient_sync` to
`last_backward` before each backward: the earlier micro-batches accumulate locally (as under
`no_sync`), the last reduces their sum once, FSDP2's arithmetic; the schedule then scales the
sharded gradients by the number of micro-batches as it does FSDP2's. Schedules that split a
backward into its input and weight parts (zero-bubble) pass `last_backward=False` to the weight
part, so they are refused here.

[Note: parameters gathered once per pipeline step]
Accumulating without reducing is not enough: each micro-batch's backward would still free every
unit and the next micro-batch gather it again, forward and backward (ZeRO-3 per micro-batch).
As torch's stage does for FSDP2, this stage also sets `set_reshard_after_backward` to
`last_backward`: the units a backward leaves unsharded stay so through the next micro-batches'
forwards and backwards, and the step's last backward reduces and frees them ([Note: retained
across micro-batches] in overlap/engine/unit_state.py). Before the stage's first backward (the
warm-up forwards of 1F1B) a unit is gathered once if it is kept from forward to backward
(reshard_after_forward=False, or within keep_for_backward_bytes: the warm-up forwards reuse
it), else once per warm-up forward and once for that backward; after it, never again that
step. So with reshard_after_forward=False each unit is gathered once per step, as FSDP2 under
torchtitan's pipeline settings. Units are kept where the whole stage's unsharded parameters fit
`max_inflight_allgather_bytes` (no cap: always); tests/parity/test_pipeline_gathers.py counts them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage as _PipelineStage


class PipelineStage(_PipelineStage):
    """torch's `PipelineStage` for a module wrapped by `overlap.wrap`: its gradients are reduced
    once per schedule step ([Note: gradients reduced once per pipeline step]) and its units are
    kept unsharded between micro-batches ([Note: parameters gathered once per pipeline step])."""

    def __init__(self, submodule: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(submodule, "_overlap_state", None) is None:
            raise TypeError(
                "overlap.integrations.pipelining.PipelineStage: the stage module is not wrapped by "
                "overlap.wrap; wrap it first (or use torch.distributed.pipelining.PipelineStage)"
            )
        super().__init__(submodule, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if backward_type != "full":
            raise NotImplementedError(
                f"overlap.integrations.pipelining.PipelineStage: a {backward_type!r} backward (a "
                "schedule splitting input and weight gradients, zero-bubble) is not supported; use "
                "Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B"
            )
        self.submod.set_requires_gradient_sync(last_backward)
        self.submod.set_reshard_after_backward(last_backward)  # [Note: parameters gathered once per pipeline step]
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _post_metadata_inference_cleanup(self) -> None:
        """torch's schedules infer shapes on their first step by a real forward and backward of
        one micro-batch, whose gradients torch drops for FSDP2's modules only: drop ours too, or
        a loss whose backward runs inside that pass (a chunked loss's head) keeps them."""
        cleanup = getattr(super(), "_post_metadata_inference_cleanup", None)
        if cleanup is not None:
            cleanup()
        self.submod.zero_grad(set_to_none=True)
