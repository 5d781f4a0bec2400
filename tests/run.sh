#!/usr/bin/env bash
# The test command (README "Tests"; .ci/run calls exactly this): installs what the suite needs on
# a clean machine, then runs it. CPU only; the whole suite is kept under 15 minutes on an idle
# 2-core machine (12 measured, installs included) and passes beside a CPU-bound process.
#   bash tests/run.sh              # everything
#   bash tests/run.sh -k parity    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch: keep the one installed (2.11 on the GPU machines); else the CPU build of 2.13.0 (a bare
# `torch` would pull a multi-GB CUDA build).
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet torch==2.13.0
DS_BUILD_OPS=0 python3 -m pip install --quiet -e ".[test,hf,plot,triton,bench,integrations,torchtitan]"
python3 -c "import torch, overlap; print('torch', torch.__version__, '| overlap', overlap.__version__)"
# Build the C++ CPU kernels once up front (JIT, cached); the kernel tests then fail rather than
# skip if the build breaks.
export OVERLAP_REQUIRE_EXT=1
# Triton came with the `triton` extra above: its tests fail, not skip, if it is missing.
export OVERLAP_REQUIRE_TRITON=1
python3 -c "from overlap.kernels import cpu; assert cpu.load_extension(), 'C++ kernels did not build'"
# The CUDA kernels are kept free of torch headers so the machine's nvcc can compile-check them.
if command -v nvcc >/dev/null; then
    for src in csrc/cuda/*.cu; do nvcc -c -arch=sm_90 -o "/tmp/overlap_$(basename "$src" .cu).o" "$src"; done
fi
# Lint and format first (configuration in pyproject.toml): seconds, and a style slip fails here
# rather than after the suite.
python3 -m ruff check .
python3 -m ruff format --check .
# A rank that aborts (SIGABRT, SIGSEGV) prints its Python stacks: spawned ranks inherit this.
export PYTHONFAULTHANDLER=1
python3 -m pytest -q --durations=15 tests "$@"
