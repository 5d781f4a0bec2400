"""What the step model knows about GPUs and the nodes they sit in: datasheet figures and the
rates public microbenchmarks report, each preset with its source.

[Note: accelerator rates]
A GPU's dense tensor-core peak is the datasheet's ("with sparsity" halved). What a training step
gets of it depends on the kernel: large bf16 GEMMs reach `gemm_share` of the peak (cuBLAS on
square-ish shapes; smaller shapes lose more, see kernels.py), flash attention reaches the share
its kernel library reports (`KernelStack` in kernels.py), and element-wise work is paid in HBM
bytes at `hbm_tbps · HBM_SHARE`. A power-capped card (torchtitan's 500 W H100s) runs its tensor
cores at lower clocks: its peak is interpolated between the datasheets of the same chip at two
power limits (H100 NVL at 400 W, H100 SXM at 700 W), as torchtitan's footnote places it; its
GEMMs and attention kernels run at the rates measured on it, which fall further below the SXM's
(`H100_500W_TENSOR_CLOCK`).

[Note: rails]
A DGX-style node has one network adapter per GPU ("rail"). NCCL builds one ring (channel) per
rail, so a collective whose group has k ranks in each node drives min(k, rails) adapters at once:
a data-parallel group of 8 ranks per node moves 8 x 400 Gb/s between nodes, a group of 1 rank
per node (tensor parallel 8 inside the node) one adapter. The bus bandwidth one rank sees
across nodes is that share of the node's rails, capped by NVLink (the ring's other hops).

[Note: compute beside a collective]
A collective hidden behind compute is not free: NCCL's kernels hold SMs and stream through the same
HBM and L2 as the kernels beside them, which run slower while it is in flight. On Hopper the
slowdown is measured: PyTorch's copy-engine collectives pass reports matmuls overlapped by NCCL
collectives 30-40% slower on 8 x H100 over NVLink (https://github.com/pytorch/pytorch/pull/179937),
the midpoint taken (`MATMUL_SLOWDOWN_BESIDE_NCCL`). PyTorch's overlapped matmul + all-gather
benchmark (benchmarks/distributed/bench_overlapped_matmul_allgather.py,
https://github.com/pytorch/pytorch/pull/172714: an 8192^3 fp16 matmul beside an all-gather of
64 MiB per rank on 8 x H100: 2.96 ms one after the other, 2.02 ms overlapped, 1.77 ms with
copy-engine all-gathers that take no SMs) bounds it: with the matmul alone at the 797.5 TFLOPS
measured on an H100 SXM at 8192^3 (1.38 ms; fp16 and bf16 share the tensor cores' peak) the
overlapped matmul takes at most 2.02 ms, 1.46x. The ISPASS 2025 characterization of the same overlap on 4 x H100,
A100, MI250 and MI210 (https://arxiv.org/abs/2507.03114) reports compute 18.9% slower on average
over its GPUs and models, up to 40%. The compute beside a collective runs at 1/slowdown of its
speed, so loses 1 - 1/1.35 = 0.26 of it (`collective_share_lost`), where NCCL's 24 SMs alone are
0.18 of an H100. No measurement of the same kind was found for Ampere or Blackwell: there the share
lost stays NCCL's SMs over the GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.step_model.cost import Link

HBM_SHARE = 0.85
"""Share of the datasheet HBM bandwidth a streaming element-wise kernel sustains (public copy
microbenchmarks on A100/H100-class cards report ~85-91% of the quoted bandwidth)."""
RAIL_SHARE = 0.9
"""Share of an adapter's line rate NCCL's inter-node rings sustain (nccl-tests busbw of one
400 Gb/s rail ~ 45 GB/s of 50; the `ndr400` preset)."""
NCCL_SMS = 24
"""SMs NCCL's collectives occupy while they overlap compute: Megatron-LM's FSDP guide
(docs/user-guide/features/megatron_fsdp.md) measures 16-32 SMs for FSDP's collectives (1-6 with
SHARP offload); the middle is taken. Where no slowdown of the compute beside a collective was
measured, it loses that share of the GPU ([Note: compute beside a collective])."""
MATMUL_SLOWDOWN_BESIDE_NCCL: dict[str, float] = {"hopper": 1.35}
"""Per GPU generation: how many times longer a matmul takes while an NCCL collective runs beside
it ([Note: compute beside a collective]: 1.3-1.4x measured on H100)."""
NVLINK_SHARE = 0.8
"""Share of NVLink's one-way rate a ring reaches (nccl-tests all_gather busbw ~360 GB/s on
8 x H100 of 450; the `nvlink4` preset)."""


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One GPU as the compute model sees it ([Note: accelerator rates])."""

    name: str
    generation: str
    """"ampere", "hopper" or "blackwell": which kernels exist (flash attention 3, fp8)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak at the card's power limit."""
    fp8_tflops: float | None
    """Dense fp8 peak; None where the tensor cores have no fp8 (A100)."""
    hbm_gib: float
    hbm_tbps: float
    power_w: float
    nvlink_gbps: float
    """NVLink one-way bandwidth per GPU, GB/s (half the datasheet's bidirectional figure)."""
    sm_count: int
    gemm_share: float
    """Share of the bf16 peak a large bf16 GEMM sustains (cuBLAS, clocks under load)."""
    fp8_gemm_share: float = 0.0
    """Share of the fp8 peak a large fp8 GEMM sustains."""
    attention_tflops: float = 0.0
    """The bf16 peak the attention kernels' shares apply to; 0: `bf16_tflops`. A power-capped
    card's tensor cores run at the clock its measured GEMM shows ([Note: accelerator rates])."""
    source: str = ""

    @property
    def attention_peak_tflops(self) -> float:
        return self.attention_tflops or self.bf16_tflops


# Datasheets: NVIDIA A100 Tensor Core GPU (SXM4: BF16 312 TFLOPS dense, 1,555 GB/s (40 GB) and
# 2,039 GB/s (80 GB), 400 W, NVLink 600 GB/s); H100 Tensor Core GPU (SXM5: BF16 1,979 / FP8 3,958
# TFLOPS with sparsity, 3.35 TB/s, 700 W, NVLink 900 GB/s; NVL: 1,671 / 3,341, 400 W); H200
# (SXM: as H100 SXM, 141 GB, 4.8 TB/s); DGX B200 (8 GPUs: 72 PF FP8 and 36 PF FP16 training
# with sparsity, 1,440 GB, 64 TB/s, NVLink 1.8 TB/s per GPU, ~1,000 W per GPU); GB200 NVL72
# (72 GPUs: 720 PF FP8 and 360 PF FP16/BF16 with sparsity, 13.4 TB at 576 TB/s, 1.8 TB/s NVLink).
# GEMM shares: the maximum achievable matmul FLOPS (MAMF) of a matmul at its best shape, measured by
# ml-engineering's mamf-finder (stas00/ml-engineering, compute/accelerator/README.md, "Maximum
# Achievable Matmul FLOPS comparison table"), bf16: A100 SXM 267.9 of 312 (85.9%), H100 SXM 792.1 of
# 989 (80.1%; "H200 is the same"), B200 SXM 1745.0 of 2250 (77.6%), GB200 1822.0 of 2500 (72.9%);
# fp8 (float8_e4m3fn): H100 SXM 1402.6 of 1979 (70.9%), H200 SXM 1453.4 (73.4%), B200 3432.5 of 4500
# (76.3%), GB200 3615.6 of 5000 (72.3%). The shapes a model runs are not the best one, so
# GEMM_SHAPE_MIX of each MAMF share is taken (bf16: 0.773 A100, 0.721 H100/H200), on Blackwell the
# mix measured at a model's shapes, BLACKWELL_GEMM_SHAPE_MIX (bf16: 0.662 B200, 0.622 GB200; fp8:
# 0.660, 0.626). Blackwell's larger peak is reached by fewer of the shapes a model runs (a lower share).
# SM counts: A100 108, H100/H200 132, B200 148 (NVIDIA architecture whitepapers).
GEMM_SHAPE_MIX = 0.9
# Blackwell's shape mix is measured at a Llama-8B-sized layer: Transformer Engine's GEMM profiling
# tutorial (docs/examples/gemm_profiling/gemm_profiling.rst, https://github.com/NVIDIA/TransformerEngine/
# blob/d0067d0da6cb01811b8072a7d304f0e00344ce2b/docs/examples/gemm_profiling/gemm_profiling.rst)
# times the 12 GEMMs of a hidden 4096, intermediate 16384 layer at M = 15,872 tokens on a B300
# (cuBLAS through TE, CUDA events over 100 iterations), pre-quantized: 13.102 ms per layer in bf16,
# 6.812 ms in fp8 (Float8CurrentScaling). The layer is 3 x 2 x 15872 x 4096 x (12288 + 4096 +
# 16384 + 16384) = 1.917e13 FLOPs: 1463 TFLOPS bf16 and 2815 fp8, 0.827 and 0.839 of the B300's
# own MAMF (B300 SXM 1769.0 bf16, 3353.3 fp8 in the same MAMF table); over the tile efficiency kernels.py gives
# those GEMMs (every min(K, N) is 4096: 4096 / 4224) that is a mix of 0.853 and 0.866 where
# Hopper's is taken as 0.9. The backward is where Blackwell loses: its dgrad + wgrad take 2.16x
# the fprop in fp8 (2.08x bf16), where the same tool on an H200 NVL measures 2.01x (2.00x). B300
# and B200 are one architecture (sm_10x, cuBLAS's Blackwell kernels) with the same 2,250 / 4,500
# TFLOPS dense peaks; taken for every Blackwell card, on its own MAMF.
_TE_LAYER_TFLOP = 3 * 2 * 15872 * 4096 * (12288 + 4096 + 16384 + 16384) / 1e12
_TE_TILE = 4096 / (4096 + 128)
BLACKWELL_GEMM_SHAPE_MIX = (_TE_LAYER_TFLOP / 13.102e-3 / 1769.0 / _TE_TILE,
                            _TE_LAYER_TFLOP / 6.812e-3 / 3353.3 / _TE_TILE)  # fmt: skip
"""(bf16, fp8) share of a Blackwell card's MAMF its GEMMs reach at a model's shapes."""
MAMF_SHARE = {  # (bf16, fp8) MAMF / datasheet peak, the table above
    "a100": (0.859, 0.0), "h100": (0.801, 0.709), "h200": (0.801, 0.734), "b200": (0.776, 0.763),
    "gb200": (0.729, 0.723),
}  # fmt: skip
# The 500 W H100 of torchtitan's Grand Teton hosts has its own measurement: FBGEMM's fp8 GEMM
# benchmark (https://github.com/pytorch/FBGEMM/pull/2546, "H100 500W") times cuBLAS bf16 at 585 TFLOPS on an
# 8192^3 GEMM and 575 / 546 on Llama-70B-sized ones (65536 x 8192 x 7168, 65536 x 3584 x 8192),
# against the power-interpolated peak of 887: 0.62-0.66 where the SXM's MAMF share x the shape
# mix gives 0.72. The 8192^3 point over its tile efficiency (kernels.py) stands where the other
# cards' MAMF does (a large square GEMM is among mamf-finder's best shapes), so it takes the same
# GEMM_SHAPE_MIX. The same benchmark checks the pairing: on this card its rowwise fp8 kernel runs
# 1125.5 TFLOPS at 8192^3, 1.92x the bf16 GEMM; the fp8 share (the SXM's fp8 MAMF x the mix, on
# the interpolated fp8 peak) x ROWWISE_KERNEL_SHARE over this bf16 share gives 1.90x (without
# the mix on bf16: 1.74x, the fp8 speed-up a fifth short of the measured one).
# The kernel libraries' attention shares are measured on the 700 W SXM. On the 500 W card the same
# tensor cores run at the clock its GEMM shows against the SXM's at the same shape: 585.2 TFLOPS
# (FBGEMM, above) against 797.5 on an H100 SXM at 8192^3 (torch 2.7 cuBLAS,
# https://github.com/zzc0721/torch-performance-test-data/issues/79): 0.734 of the SXM, where the
# datasheet interpolation above gives 0.897. Attention is taken to lose what the GEMM loses.
H100_500W_TENSOR_CLOCK = 585.2 / 797.5
H100_500W_GEMM_SHARE = (585.2 / (835.5 + (989.4 - 835.5) * (500 - 400) / (700 - 400)) / (8192 / (8192 + 128))
                        * GEMM_SHAPE_MIX)  # fmt: skip
# fmt: off
_HOPPER = dict(generation="hopper", gemm_share=MAMF_SHARE["h100"][0] * GEMM_SHAPE_MIX,
               fp8_gemm_share=MAMF_SHARE["h100"][1] * GEMM_SHAPE_MIX, nvlink_gbps=450.0, sm_count=132)
# fmt: on
# fmt: off
ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator(name="A100 SXM4 40GB", generation="ampere", bf16_tflops=312.0, fp8_tflops=None,
                             hbm_gib=40, hbm_tbps=1.555, power_w=400, nvlink_gbps=300.0, sm_count=108,
                             gemm_share=MAMF_SHARE["a100"][0] * GEMM_SHAPE_MIX,
                             source="NVIDIA A100 datasheet"),
    "a100-80gb": Accelerator(name="A100 SXM4 80GB", generation="ampere", bf16_tflops=312.0, fp8_tflops=None,
                             hbm_gib=80, hbm_tbps=2.039, power_w=400, nvlink_gbps=300.0, sm_count=108,
                             gemm_share=MAMF_SHARE["a100"][0] * GEMM_SHAPE_MIX,
                             source="NVIDIA A100 datasheet"),
    "h100-sxm": Accelerator(name="H100 SXM 80GB (700 W)", bf16_tflops=989.4, fp8_tflops=1979.0, hbm_gib=80,
                            hbm_tbps=3.35, power_w=700, source="NVIDIA H100 datasheet (SXM5)", **_HOPPER),
    "h100-96gb-500w": Accelerator(
        name="H100 96GB HBM2e (500 W)", bf16_tflops=835.5 + (989.4 - 835.5) * (500 - 400) / (700 - 400),
        fp8_tflops=1670.5 + (1979.0 - 1670.5) * (500 - 400) / (700 - 400), hbm_gib=96, hbm_tbps=2.4, power_w=500,
        source="torchtitan benchmarks (Grand Teton hosts: 96 GB HBM2e, 2.4 TB/s, 500 W; peak 'between SXM "
        "and NVL'): peak interpolated by power between the H100 NVL (400 W) and SXM (700 W) datasheets; "
        "bf16 GEMM share measured on this card (FBGEMM); attention at the clock that GEMM shows",
        attention_tflops=989.4 * H100_500W_TENSOR_CLOCK, **{**_HOPPER, "gemm_share": H100_500W_GEMM_SHARE}),
    "h200": Accelerator(name="H200 SXM 141GB", bf16_tflops=989.4, fp8_tflops=1979.0, hbm_gib=141, hbm_tbps=4.8,
                        power_w=700, source="NVIDIA H200 datasheet; fp8 GEMM share: H200 SXM MAMF",
                        **{**_HOPPER, "fp8_gemm_share": MAMF_SHARE["h200"][1] * GEMM_SHAPE_MIX}),
    "b200": Accelerator(name="B200 (DGX B200)", generation="blackwell", bf16_tflops=2250.0, fp8_tflops=4500.0,
                        hbm_gib=180, hbm_tbps=8.0, power_w=1000, nvlink_gbps=900.0, sm_count=148,
                        gemm_share=MAMF_SHARE["b200"][0] * BLACKWELL_GEMM_SHAPE_MIX[0],
                        fp8_gemm_share=MAMF_SHARE["b200"][1] * BLACKWELL_GEMM_SHAPE_MIX[1],
                        source="NVIDIA DGX B200 datasheet, per GPU; GEMM shares: B200 SXM MAMF x TE's "
                        "measured Blackwell shape mix"),
    "gb200": Accelerator(name="B200 in GB200 NVL72", generation="blackwell", bf16_tflops=2500.0, fp8_tflops=5000.0,
                         hbm_gib=186, hbm_tbps=8.0, power_w=1200, nvlink_gbps=900.0, sm_count=148,
                         gemm_share=MAMF_SHARE["gb200"][0] * BLACKWELL_GEMM_SHAPE_MIX[0],
                         fp8_gemm_share=MAMF_SHARE["gb200"][1] * BLACKWELL_GEMM_SHAPE_MIX[1],
                         source="NVIDIA GB200 NVL72 datasheet, per GPU; GEMM shares: GB200 MAMF x TE's "
                         "measured Blackwell shape mix"),
}
# fmt: on


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """The GPUs NVLink joins and the adapters between them and the rest ([Note: rails])."""

    name: str
    gpus_per_node: int
    """GPUs of one host (what --gpus-per-node means)."""
    nvlink_domain: int
    """GPUs one NVLink fabric joins: the node, or 72 for an NVL72 rack."""
    rails: int
    """Network adapters per host, one per GPU on DGX-style nodes."""
    rail_gbit: float
    """Line rate of one adapter, Gb/s."""
    alpha_intra_s: float = 8e-6
    alpha_inter_s: float = 15e-6
    source: str = ""

    def rail_gbps(self) -> float:
        return self.rail_gbit / 8 * RAIL_SHARE


# fmt: off
NODES: dict[str, NodeSpec] = {
    "dgx-a100": NodeSpec(name="DGX A100 (8 x 200G HDR)", gpus_per_node=8, nvlink_domain=8, rails=8, rail_gbit=200,
                         source="NVIDIA DGX A100 datasheet: 8 x ConnectX-6 200 Gb/s compute adapters (Selene)"),
    "dgx-h100": NodeSpec(name="DGX H100 (8 x 400G NDR)", gpus_per_node=8, nvlink_domain=8, rails=8, rail_gbit=400,
                         source="NVIDIA DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s"),
    "dgx-h200": NodeSpec(name="DGX H200 (8 x 400G)", gpus_per_node=8, nvlink_domain=8, rails=8, rail_gbit=400,
                         source="NVIDIA DGX H200 datasheet: 8 x ConnectX-7 400 Gb/s"),
    "grand-teton": NodeSpec(name="Grand Teton H100 (400G RDMA per GPU)", gpus_per_node=8, nvlink_domain=8, rails=8,
                            rail_gbit=400, source="torchtitan benchmarks: 400 Gb/s RDMA per GPU"),
    "dgx-b200": NodeSpec(name="DGX B200 (8 x 400G)", gpus_per_node=8, nvlink_domain=8, rails=8, rail_gbit=400,
                         source="NVIDIA DGX B200 datasheet: 8 x ConnectX-7 400 Gb/s"),
    "gb200-nvl72": NodeSpec(name="GB200 NVL72 (4 GPUs per tray, 400G each)", gpus_per_node=4, nvlink_domain=72,
                            rails=4, rail_gbit=400,
                            source="NVIDIA GB200 NVL72: 18 trays of 4 GPUs on one NVLink fabric, ConnectX-7 400G per GPU"),
}
# fmt: on


def ring_link(gpu: Accelerator, node: NodeSpec, group_size: int, ranks_per_node: int) -> Link:
    """The link one collective's ring runs at for a group of `group_size` ranks with
    `ranks_per_node` of them in each host ([Note: rails]): NVLink while the group stays in one
    NVLink domain, else the group's share of the rails (capped by NVLink)."""
    nvlink = gpu.nvlink_gbps * NVLINK_SHARE
    hosts_spanned = group_size // max(ranks_per_node, 1)
    if group_size <= ranks_per_node or hosts_spanned * node.gpus_per_node <= node.nvlink_domain:
        return Link(f"nvlink ({gpu.name})", node.alpha_intra_s, nvlink, gpu.source)
    rails_used = min(ranks_per_node, node.rails)
    busbw = min(nvlink, rails_used * node.rail_gbps())
    return Link(f"{rails_used} x {node.rail_gbit:g}G rails", node.alpha_inter_s, busbw, node.source)


def collective_share_lost(gpu: Accelerator) -> float:
    """Share of its speed the compute beside a collective in flight loses ([Note: compute beside
    a collective]): the measured matmul slowdown of the GPU's generation, else NCCL's SMs."""
    slowdown = MATMUL_SLOWDOWN_BESIDE_NCCL.get(gpu.generation)
    if slowdown is None:
        return NCCL_SMS / gpu.sm_count
    return 1.0 - 1.0 / slowdown


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; use one of {sorted(ACCELERATORS)}") from None


def node_spec(name: str) -> NodeSpec:
    try:
        return NODES[name]
    except KeyError:
        raise ValueError(f"unknown node {name!r}; use one of {sorted(NODES)}") from None
