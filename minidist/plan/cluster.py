"""GPUs and the links between them, from the datasheets.

    python -m minidist.plan --params 70e9 --gpus 1024 --gpu h100-sxm

Peaks are the dense 16-bit (bf16/fp16) tensor-core figures, never the sparse ones
(which the datasheets print beside them at twice the value):
  A100 80GB SXM  312 TFLOP/s, 80 GB HBM2e at 2,039 GB/s  (NVIDIA A100 Tensor Core GPU
                 datasheet, "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*", * = sparsity)
  H100 SXM       989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s    (NVIDIA H100 Tensor Core GPU
                 datasheet, "BF16 Tensor Core 1,979 teraFLOPS*", * = with sparsity: 989 dense)
  H200 (SXM)     989 TFLOP/s, 141 GB HBM3e at 4.8 TB/s   (NVIDIA H200 datasheet; the same
                 Hopper tensor cores as H100 SXM, "1,979 TFLOPS*" with sparsity)

Links, bytes per second per GPU in one direction (the ring's bottleneck):
  NVLink 3 (A100)  600 GB/s bidirectional -> 300 GB/s each way (A100 datasheet)
  NVLink 4 (H100, H200)  900 GB/s bidirectional -> 450 GB/s each way (H100 datasheet)
  InfiniBand, one NIC per GPU: DGX A100 / Selene 8 x 200 Gb/s HDR -> 25 GB/s per GPU
  (Narayanan et al. 2021, section 5; DGX A100 user guide); DGX H100 8 x 400 Gb/s NDR ->
  50 GB/s per GPU (DGX H100 user guide); Llama 3's RoCE fabric is also 400 Gb/s per GPU
  (Grattafiori et al. 2024, arXiv 2407.21783, section 3.3.1).
Latencies (alpha, seconds per message step) are this project's round figures, not a
datasheet's: 5 us inside a node, 10 us across nodes (NCCL's per-step latencies are of
that order; they matter only for small messages and long rings).

matmul_efficiency: the fraction of the dense peak that the training step's matrix
products reach, one number per GPU type, set once (below; docs/reference.md#the-planner;
cost.py shows what it multiplies). It is never tuned per layout or per row.
HBM bandwidth times the elementwise kernels' bytes gives their time (cost.py).
"""
from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense 16-bit tensor-core FLOP/s
    memory_bytes: float        # HBM capacity
    hbm_bytes_per_s: float     # HBM bandwidth
    matmul_efficiency: float   # fraction of peak_flops the matrix products reach
    intra_bw: float            # NVLink, bytes/s per GPU, one direction
    inter_bw: float            # network, bytes/s per GPU, one direction
    source: str


# The efficiencies, one rule for each GPU type, applied once: the value (to 0.01) that
# minimises the worst relative error over that type's published rows (plan.published), then
# the next worst where rows the constant cannot move share the worst (plan.published.fit;
# tests/test_plan.py checks that 0.01 either way is worse; plan.published.fit_constants()
# recomputes both, to be rerun after any change to the cost model). One number for 27 A100
# rows from five sources and one for 13 H100 rows from two: the spread left is the model's,
# and lesson 12 prints each row's error with the constant fitted WITHOUT its source
# (leave-one-source-out) beside it. H200 has no published row here; it keeps H100's tensor
# cores and so H100's figure. Read them as "the fraction of peak a whole training step's
# matrix products reached", not as a GEMM benchmark: H100's absorbs what the planner does not
# model of Llama 3's and MosaicML's runs (FSDP's details, how Meta counts causal attention's
# FLOPs, attention kernels slower than the GEMMs, stragglers); large bf16 GEMMs alone reach
# well above it. History: A100 0.69 and H100 0.52 over the 21 rows of Korthikanti,
# Narayanan and Llama 3 (H100 fitted partly to the 128K row, whose DP 8 is inferred: Table 4
# prints DP 4, which fits neither its 16,384 GPUs nor its 16M tokens); 0.63 and 0.51 once
# MT-NLG, BLOOM and MosaicML's rows joined.
A100_EFFICIENCY = 0.63
H100_EFFICIENCY = 0.51

GPUS = {
    "a100-80gb": GPU("a100-80gb", 312e12, 80 * GB, 2039 * GB, A100_EFFICIENCY, 300 * GB, 25 * GB,
                     "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16, 80 GB, 2,039 GB/s, NVLink 600 GB/s"),
    "h100-sxm": GPU("h100-sxm", 989e12, 80 * GB, 3350 * GB, H100_EFFICIENCY, 450 * GB, 50 * GB,
                    "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (SXM), 80 GB, 3.35 TB/s, NVLink 900 GB/s"),
    "h200": GPU("h200", 989e12, 141 * GB, 4800 * GB, H100_EFFICIENCY, 450 * GB, 50 * GB,
                "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16, 141 GB, 4.8 TB/s, NVLink 900 GB/s"),
}

INTRA_ALPHA = 5e-6     # seconds per message step inside a node (this project's figure)
INTER_ALPHA = 10e-6    # across nodes


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus: int
    gpus_per_node: int
    intra_bw: float       # bytes/s per GPU, one direction, inside a node
    intra_alpha: float    # seconds
    inter_bw: float       # bytes/s per GPU, one direction, across nodes
    inter_alpha: float

    def link(self, span):
        """(alpha, bandwidth) of a group whose ranks lie within `span` consecutive ranks:
        NVLink when that fits in a node, the network otherwise."""
        if span <= self.gpus_per_node:
            return self.intra_alpha, self.intra_bw
        return self.inter_alpha, self.inter_bw


def make_cluster(gpu_name, gpus, gpus_per_node=8, intra_bw=None, intra_alpha=INTRA_ALPHA,
                 inter_bw=None, inter_alpha=INTER_ALPHA, gpu=None):
    """A Cluster of `gpus` GPUs of a GPUS type (or a given GPU), nodes of gpus_per_node.
    Raises ValueError (one line) for an unknown name or a count that fills no whole node."""
    if gpu is None:
        if gpu_name not in GPUS:
            raise ValueError(f"unknown GPU {gpu_name!r}: one of {', '.join(GPUS)}")
        gpu = GPUS[gpu_name]
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"need at least one GPU and one GPU per node, not {gpus} and {gpus_per_node}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs is not a multiple of the node size {gpus_per_node}")
    return Cluster(gpu, gpus, gpus_per_node, gpu.intra_bw if intra_bw is None else intra_bw,
                   intra_alpha, gpu.inter_bw if inter_bw is None else inter_bw, inter_alpha)


def with_efficiency(gpu, efficiency):
    """The same GPU with another matmul efficiency (for sensitivity tables, never per row)."""
    return replace(gpu, matmul_efficiency=efficiency)
