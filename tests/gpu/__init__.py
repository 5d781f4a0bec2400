"""What one GPU can prove about the CUDA path, as pytest tests (`-m cuda`).

Every test here is one *part* of the GPU check (tests/gpu/parts.py lists them with their time
budgets); `benchmarks/gpu_check.py` runs them under those budgets and writes the JSON report.
Without a GPU they skip, unless `OVERLAP_GPU_DEVICE=cpu` dry-runs the parts that can run on the
CPU (what `benchmarks/gpu_check.py --device cpu` and tests/tools/test_gpu_check.py do), so that the
checks cannot rot while no GPU runs them.
"""
