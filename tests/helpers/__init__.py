"""What the tests share: the local world of gloo ranks (harness), small models and their training
loops (models), tolerances and shard comparisons (tolerance), the probes a rank function watches
with (probes), tiny Hugging Face models (hf) and the kernel tests' inputs (kernel_inputs)."""
