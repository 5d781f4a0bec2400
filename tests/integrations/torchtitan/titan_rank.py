"""One rank of a torchtitan world (started by launch.py): runs torchtitan's own Trainer once per
entry of a spec, with FSDP2 or overlap as the data-parallel step, and writes what each run saw.

    python titan_rank.py spec.json      # RANK, WORLD_SIZE, MASTER_ADDR/PORT set by launch.py

Per run: the loss and grad norm torchtitan logs each step (at full precision, from
`MetricsProcessor.log`), a digest of every parameter's full value just before training, the
number of overlap units, and the error a run expected to be refused raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any

import titan_shims as shims

shims.install_device()

import torch
import torchtitan  # noqa: F401
from torch.distributed.tensor import DTensor

shims.install_fsdp_sum()
shims.install_pipeline_step()

import torchtitan.trainer as titan_trainer
from titan_data import SyntheticLoader, SyntheticTokenizer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.validate import Validator
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.trainer import Trainer

import overlap
from overlap.integrations.torchtitan import use_overlap

_STEPS: list[dict[str, float]] = []


def _record_log(original: Any) -> Any:
    def log(self: Any, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, **kw: Any) -> None:
        _STEPS.append({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)})
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, **kw)

    return log


MetricsProcessor.log = _record_log(MetricsProcessor.log)


class _NoSleep:
    """The `time` module, less `sleep`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


def _train_then_barrier(original: Any) -> Any:
    """`Trainer.train` ends with rank 0 sleeping 2 s "for other ranks to complete" (2 s of every
    run, a third of a module's world); every rank waits in a barrier for the others instead."""

    def train(self: Any) -> None:
        titan_trainer.time = _NoSleep()
        try:
            original(self)
        finally:
            titan_trainer.time = time
        torch.distributed.barrier()

    return train


Trainer.train = _train_then_barrier(Trainer.train)


def base_config(model: str) -> Trainer.Config:
    """torchtitan's own debug-model config of `model` (its defaults: chunked loss, selective AC)."""
    if model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        return llama3_debugmodel()
    if model == "qwen3_moe":
        from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

        return qwen3_moe_debug()
    if model == "deepseek_v3":
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        return deepseek_v3_debugmodel()
    raise ValueError(f"unknown model {model!r}")


def build_config(spec: dict[str, Any], dump_root: str) -> Trainer.Config:
    config = base_config(spec.get("model", "llama3"))
    model = config.model_spec.model
    shims.use_sdpa(model)
    if "n_layers" in spec:  # fewer blocks of the same debug model: a shorter run
        model.layers = model.layers[: spec["n_layers"]]
    if spec.get("loss") == "ce":
        config.loss = config.loss.loss_fn  # torchtitan's CrossEntropyLoss, unchunked
    ac = spec.get("ac", "selective")
    config.activation_checkpoint = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    config.dump_folder = os.path.join(dump_root, spec["name"])
    config.tokenizer = SyntheticTokenizer.Config()
    config.dataloader = SyntheticLoader.Config(vocab_size=model.vocab_size)
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.validator = Validator.Config(enable=False)
    training = config.training
    training.steps = spec.get("steps", 3)
    training.seq_len = spec.get("seq_len", 64)
    training.local_batch_size = spec.get("local_batch_size", 2)
    training.global_batch_size = spec.get("global_batch_size", -1)
    training.mixed_precision_param = spec.get("param_dtype", "float32")
    training.disable_cuda_graphs = True
    training.enable_cpu_offload = bool(spec.get("cpu_offload", False))
    parallelism = config.parallelism
    parallelism.spmd_backend = spec.get("spmd_backend", "partial_dtensor")
    parallelism.tensor_parallel_degree = spec.get("tp", 1)
    parallelism.pipeline_parallel_degree = spec.get("pp", 1)
    parallelism.expert_parallel_degree = spec.get("ep", 1)
    parallelism.fsdp_reshard_after_forward = spec.get("reshard", "default")
    if "pp_schedule" in spec:
        parallelism.pipeline_parallel_schedule = spec["pp_schedule"]
    config.compile.enable = bool(spec.get("compile", False))
    config.compile.backend = spec.get("compile_backend", "inductor")
    config.debug.seed = 42
    config.comm.init_timeout_seconds = config.comm.train_timeout_seconds = 600  # a loaded machine
    ckpt = config.checkpoint
    ckpt.enable = "checkpoint" in spec
    if ckpt.enable:
        ckpt.folder = os.path.join(dump_root, spec["checkpoint"]["folder"])  # shared by the runs that name it
        ckpt.interval = spec["checkpoint"].get("interval", 2)
        ckpt.load_step = spec["checkpoint"].get("load_step", -1)
        ckpt.last_save_model_only = False
    if spec["impl"] == "overlap":
        config = use_overlap(config, **spec.get("overrides", {}))
    return config


def param_digests(model_parts: list[torch.nn.Module]) -> dict[str, str]:
    """sha1 of every parameter's full value (a collective for DTensors: every rank calls it)."""
    digests = {}
    for part in model_parts:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            data = full.detach().contiguous().view(torch.uint8) if full.numel() else full.detach()
            digests[name] = hashlib.sha1(data.numpy().tobytes()).hexdigest()
    return digests


def num_units(model_parts: list[torch.nn.Module]) -> int:
    states = [getattr(part, "_overlap_state", None) for part in model_parts]
    return sum(len(s.units) + sum(len(e.units) for e in s.experts) for s in states if s is not None)


def run(spec: dict[str, Any], dump_root: str) -> dict[str, Any]:
    _STEPS.clear()
    start, baseline = time.monotonic(), shims.rss_bytes()
    config = build_config(spec, dump_root)
    trainer = None
    try:
        trainer = config.build()
        result: dict[str, Any] = {
            "init": param_digests(trainer.model_parts),
            "units": num_units(trainer.model_parts),
            "build_peak_rss_bytes": shims.peak_rss_bytes(),  # the peak through build and init
        }
        trainer.train()
    except Exception as error:
        if "expect_error" not in spec:
            raise
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        if trainer is not None:
            trainer.close()
    if "expect_error" in spec:
        raise AssertionError(f"run {spec['name']}: expected an error, trained instead")
    result["steps"] = list(_STEPS)
    result["seconds"] = time.monotonic() - start  # build, init and training
    # the process's peak (its first run's alone in a fresh process) and its size before the build
    result.update(peak_rss_bytes=shims.peak_rss_bytes(), baseline_rss_bytes=baseline)
    if spec["impl"] == "overlap":  # overlap's own buffers (gathered, reduced): high-water by kind
        stats = overlap.memory_stats(trainer.model_parts[0])
        result["overlap_peak_bytes"] = {**stats.peak, "total": stats.peak_total_bytes}
    return result


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    out = os.path.join(spec["out"], f"rank{rank}.json")
    try:
        for entry in spec["runs"]:
            results[entry["name"]] = run(entry, spec["out"])
            with open(out, "w") as f:  # after every run: a later hang keeps what finished
                json.dump(results, f)
    except BaseException:
        results["__error__"] = traceback.format_exc()
        with open(out, "w") as f:
            json.dump(results, f)
        raise
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
