"""torchtitan's Trainer, llama3's debug model (2 of its 6 blocks, 2-3 steps), 2 ranks of data
parallelism: overlap (`use_overlap`) against FSDP2 on the same flags, bitwise in every logged loss,
grad norm and initial parameter; DCP resume across implementations; the spmd_types backend."""

import pytest
from titan_launch import WORLD_TIMEOUT_S, assert_same_training

WORLD_SIZE = 2
# slow: a world of fresh processes; the first test waits for the whole world
pytestmark = [pytest.mark.slow, pytest.mark.timeout(WORLD_TIMEOUT_S + 60)]

# torchtitan's defaults: chunked loss (8 chunks), selective AC, bf16 parameters, fp32 reduction,
# reshard_after_forward_policy "default", gradients summed over dp (divide factor 1)
DEFAULTS = {"n_layers": 2, "steps": 3, "param_dtype": "bfloat16"}
# gradient accumulation (2 micro-batches a step), full AC, fp32, "never"; DCP saves at step 2
ACCUM = {"n_layers": 2, "steps": 3, "ac": "full", "global_batch_size": 8, "reshard": "never"}
# per-block and loss compile through dynamo and AOTAutograd (aot_eager: what overlap's hooks meet;
# inductor's code generation is torch's and costs a cold compile of ~45 s here), "always"
COMPILED = {
    "n_layers": 2,
    "steps": 2,
    "compile": True,
    "compile_backend": "aot_eager",
    "ac": "none",
    "reshard": "always",
}


def _ckpt(folder: str, **kw: int) -> dict:
    return {"checkpoint": {"folder": folder, "interval": 2, **kw}}


RUNS = [
    {"name": "defaults-fsdp2", "impl": "fsdp2", **DEFAULTS},
    {"name": "defaults-overlap", "impl": "overlap", **DEFAULTS},
    {"name": "spmd-types-overlap", "impl": "overlap", **DEFAULTS, "spmd_backend": "spmd_types"},
    {"name": "accum-fsdp2", "impl": "fsdp2", **ACCUM, **_ckpt("ckpt-fsdp2")},
    {"name": "accum-overlap", "impl": "overlap", **ACCUM, **_ckpt("ckpt-overlap")},
    {"name": "resume-own", "impl": "overlap", **ACCUM, **_ckpt("ckpt-overlap", load_step=2)},
    {"name": "resume-from-fsdp2", "impl": "overlap", **ACCUM, **_ckpt("ckpt-fsdp2", load_step=2)},
    {"name": "compile-fsdp2", "impl": "fsdp2", **COMPILED},
    {"name": "compile-overlap", "impl": "overlap", **COMPILED},
    # last, the refusals
    {"name": "cpu-offload", "impl": "overlap", "n_layers": 2, "cpu_offload": True, "expect_error": "CPU offload"},
    {
        "name": "spmd-types-tp",
        "impl": "overlap",
        "n_layers": 2,
        "tp": 2,
        "spmd_backend": "spmd_types",
        "expect_error": "--parallelism.spmd_backend partial_dtensor",
    },
]


def test_defaults_equal_fsdp2(results):
    """Chunked loss, selective AC, bf16 parameters with fp32 reduction, sum over dp."""
    assert_same_training(results, "defaults-fsdp2", "defaults-overlap")
    # tok_embeddings, 2 blocks (FSDP2's fully_shard calls) and the root with norm and lm_head
    assert [r["defaults-overlap"]["units"] for r in results] == [4, 4]


def test_accumulation_full_ac_equal_fsdp2(results):
    assert_same_training(results, "accum-fsdp2", "accum-overlap")


def test_dcp_resume(results):
    """Resumed at step 2 from overlap's own checkpoint and from FSDP2's, step 3 is step 3 of
    the uninterrupted run (which also restores the data loader and the learning rate)."""
    for rank, runs in enumerate(results):
        want = runs["accum-fsdp2"]["steps"][2:]
        for resumed in ("resume-own", "resume-from-fsdp2"):
            assert runs[resumed]["steps"] == want, f"rank {rank}: {resumed} {runs[resumed]['steps']} != {want}"


def test_compile_equal_fsdp2(results):
    assert_same_training(results, "compile-fsdp2", "compile-overlap")


def test_spmd_types_data_parallel_equal_fsdp2(results):
    """torchtitan 0.3's default backend with data parallelism only: FSDP2's numbers (FSDP2 itself
    needs a torch nightly for it, so it ran on partial_dtensor)."""
    assert_same_training(results, "defaults-fsdp2", "spmd-types-overlap")


def test_spmd_types_with_tp_refused_on_every_rank(results):
    for rank, runs in enumerate(results):
        error = runs["spmd-types-tp"]["error"]
        assert error.startswith("ValueError") and "--parallelism.spmd_backend partial_dtensor" in error, (rank, error)
        assert "dims ['tp'] are not data parallel" in error, (rank, error)


def test_cpu_offload_refused_on_every_rank(results):
    for rank, runs in enumerate(results):
        error = runs["cpu-offload"]["error"]
        assert error.startswith("ValueError") and "--training.enable_cpu_offload" in error, (rank, error)
