"""Named models, hardware, and the published figures the benchmarks compare with.

Models
  * `zb-1.5b`, `zb-6.2b`, `zb-14.6b`, `zb-28.3b`: the Zero Bubble paper's
    GPT-3-like models (Qi et al., ICLR 2024, arXiv 2401.10241, Table 3:
    layers, heads, hidden, sequence 1024, microbatch size 6/3/1/1). The
    vocabulary is not in the paper; GPT-2's BPE (50257) is assumed.
  * `qwen2-12.1b`, `qwen2-26.3b`: Qwen2-style models (GQA, SwiGLU, vocabulary
    152064) for the STP paper's LLM experiments (arXiv 2510.27257,
    experiments: A800-80GB, TP 2-8, PP 2-8, sequence 2048-8192). The paper's model table
    was not available to us; these shapes are ASSUMED: Qwen2 layer shapes
    whose parameter count matches the name (12.0B and 26.3B by
    `num_parameters`) with a layer count of the form k*PP - 2 for PP in
    {2, 4, 8}, as the paper splits the model with two fewer layers on the
    last stage. Override any field: `--model qwen2-12.1b,sequence=6144,tp=8`.
  * `qwen2-72b`: Qwen2-72B as published (Yang et al., "Qwen2 Technical
    Report", arXiv 2407.10671, Table 1, and its released config.json: 80
    layers, hidden 8192, 64 query / 8 key-value heads, SwiGLU width 29568,
    vocabulary 152064, untied head); sequence 4096, tp 8 by default.
  * `llama3-405b`: Llama 3 405B as published (Llama Team, "The Llama 3 Herd
    of Models", arXiv 2407.21783, Table 3: 126 layers, model dimension
    16384, FFN dimension 53248, 128 attention / 8 key-value heads,
    vocabulary 128000 (128256 in the released config.json, used here);
    pre-training sequence 8192, tp 8 (section 3.3.2).
  * `mixtral-8x7b`: Mixtral 8x7B as published (Jiang et al., "Mixtral of
    Experts", arXiv 2401.04088, Table 1, and its released config.json: 32
    layers, dim 4096, 32 query / 8 key-value heads, 8 experts of SwiGLU
    width 14336, top-2 routing, vocabulary 32000, untied head): 46.7B
    parameters, 12.9B active (`costmodel.moe.spec.active_parameters`); sequence
    4096, tp 1 and ep 8 by default.
  * `qwen2-57b-a14b`: Qwen2-57B-A14B as published (Yang et al., "Qwen2
    Technical Report", arXiv 2407.10671, Table 1, and its released
    config.json: 28 layers, hidden 3584, 28 query / 4 key-value heads, 64
    experts of SwiGLU width 2560, top-8 routing without renormalisation, a
    shared expert of width 20480 with its sigmoid gate, vocabulary 151936,
    untied head): 57.4B parameters, 14.2B active; sequence 4096, tp 1 and
    ep 8 by default.
  * `mllm-qwen2vl-7b`: a multimodal model (Qwen2-VL-7B's shapes), in
    `stp.costmodel.mllm.spec.MLLM_MODELS`.

Hardware (16-bit dense peak from NVIDIA's A100 / A800 datasheets; link
bandwidths are one direction; `efficiency` and the effective bandwidths are
assumptions, override them with `--hardware a800-80g,efficiency=0.45`)
  * `a100-80g`: NVLink 600 GB/s both directions; the Zero Bubble paper's
    nodes are linked by RoCE (assumed 200 Gb/s per GPU).
  * `a800-80g`: the export variant, NVLink capped at 400 GB/s both directions.
  * `h100-80g`: H100 SXM5 (NVIDIA H100 datasheet: 989 TFLOP/s dense BF16,
    NVLink 900 GB/s both directions; assumed 300 GB/s effective one way, as
    a100-80g takes 2/3 of its link; 400 Gb/s InfiniBand per GPU between
    pipeline stages; PCIe Gen5 to the host, 50 GB/s assumed effective).
  * `h200-141g`: H200 SXM (NVIDIA H200 datasheet: the H100's 989 TFLOP/s dense
    BF16 and NVLink, 141 GB of HBM3e); links as `h100-80g`.
`memory` is each card's total as nvidia-smi reports it: 81920 MiB on the
A100 / A800 80 GB, 81559 MiB on the H100 80 GB, 143771 MiB on the H200.
In-layer TP overlap's two fields (`tp_chunk_launch`, `gemm_rows`) keep the
assumed defaults of `stp.costmodel.hardware` on every preset: no GPU was at
hand to measure them; `stp plan --hardware local` measures this machine's.
"""

from __future__ import annotations

from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.moe.spec import MoESpec

__all__ = [
    "MODELS",
    "HARDWARE",
    "ZB_PROFILED",
    "ZB_BUBBLE_RATES",
    "ZB_BUBBLE_COLUMNS",
    "STP_REPORTED",
]


def _gpt(name: str, layers: int, heads: int, hidden: int, micro_batch: int) -> ModelSpec:
    return ModelSpec(
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
        vocab=50257, sequence=1024, micro_batch=micro_batch, gated_mlp=False, name=name,
    )


def _qwen2(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(
        layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=152064,
        sequence=4096, micro_batch=1, tp=8, gated_mlp=True, flash_attention=True, name=name,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(
        layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn, vocab=128256,
        sequence=8192, micro_batch=1, tp=8, gated_mlp=True, flash_attention=True, name=name,
    )


def _mixtral_8x7b() -> MoESpec:
    return MoESpec(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, sequence=4096,
        micro_batch=1, tp=1, gated_mlp=True, flash_attention=True, name="mixtral-8x7b",
        experts=8, top_k=2, expert_ffn=14336, ep=8,
    )


def _qwen2_57b_a14b() -> MoESpec:
    return MoESpec(
        layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, vocab=151936, sequence=4096,
        micro_batch=1, tp=1, gated_mlp=True, flash_attention=True, name="qwen2-57b-a14b",
        experts=64, top_k=8, expert_ffn=2560, shared_expert_ffn=20480, ep=8,
    )


_MIB = 1 << 20

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _gpt("zb-1.5b", 22, 24, 2304, 6),
        _gpt("zb-6.2b", 30, 32, 4096, 3),
        _gpt("zb-14.6b", 46, 40, 5120, 1),
        _gpt("zb-28.3b", 62, 48, 6144, 1),
        _qwen2("qwen2-12.1b", 38, 5120, 40, 13824),
        _qwen2("qwen2-26.3b", 46, 7168, 56, 18944),
        _qwen2("qwen2-72b", 80, 8192, 64, 29568),
        _llama3("llama3-405b", 126, 16384, 128, 53248),
        _mixtral_8x7b(),
        _qwen2_57b_a14b(),
    ]
}

HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in [
        HardwareSpec(
            name="a100-80g", peak_flops=312e12, efficiency=0.5, tp_bandwidth=200e9,
            tp_latency=5e-6, pp_bandwidth=25e9, pp_latency=10e-6, host_bandwidth=25e9,
            memory=81920 * _MIB,
        ),
        HardwareSpec(
            name="a800-80g", peak_flops=312e12, efficiency=0.5, tp_bandwidth=130e9,
            tp_latency=5e-6, pp_bandwidth=25e9, pp_latency=10e-6, host_bandwidth=25e9,
            memory=81920 * _MIB,
        ),
        HardwareSpec(
            name="h100-80g", peak_flops=989e12, efficiency=0.5, tp_bandwidth=300e9,
            tp_latency=5e-6, pp_bandwidth=50e9, pp_latency=10e-6, host_bandwidth=50e9,
            memory=81559 * _MIB,
        ),
        HardwareSpec(
            name="h200-141g", peak_flops=989e12, efficiency=0.5, tp_bandwidth=300e9,
            tp_latency=5e-6, pp_bandwidth=50e9, pp_latency=10e-6, host_bandwidth=50e9,
            memory=143771 * _MIB,
        ),
    ]
}

# Zero Bubble paper, Appendix D, Table 9: profiled T_F, T_B, T_W, T_comm (ms)
# of one stage; (model, p, m) -> (f, b, w, comm).
ZB_PROFILED: dict[tuple[str, int, int], tuple[float, float, float, float]] = {
    ("zb-1.5b", 8, 24): (18.522, 18.086, 9.337, 0.601),
    ("zb-1.5b", 8, 32): (18.513, 18.086, 9.331, 0.626),
    ("zb-1.5b", 8, 64): (18.546, 18.097, 9.321, 0.762),
    ("zb-6.2b", 8, 24): (29.718, 29.444, 19.927, 0.527),
    ("zb-6.2b", 8, 32): (29.802, 29.428, 19.530, 0.577),
    ("zb-6.2b", 8, 64): (29.935, 29.621, 19.388, 0.535),
    ("zb-14.6b", 16, 48): (11.347, 11.248, 8.132, 0.377),
    ("zb-14.6b", 16, 64): (11.307, 11.254, 8.101, 0.379),
    ("zb-14.6b", 16, 128): (11.325, 11.308, 8.109, 0.378),
    ("zb-28.3b", 32, 96): (10.419, 10.207, 7.715, 0.408),
    ("zb-28.3b", 32, 128): (10.408, 10.204, 7.703, 0.408),
    ("zb-28.3b", 32, 256): (10.402, 10.248, 7.698, 0.460),
}

ZB_BUBBLE_COLUMNS = ("1f1b", "1f1b-i", "zb-h1", "zb-h2", "zb-1p", "zb-2p")
"""Columns of ZB_BUBBLE_RATES; zb-1p / zb-2p are the paper's searched
schedules at memory limits p M_B / 2p M_B."""

# Zero Bubble paper, section 5.3, Table 5: bubble rates computed by the
# authors from the profiled costs above (not measured).
ZB_BUBBLE_RATES: dict[tuple[str, int, int], tuple[float, ...]] = {
    ("zb-1.5b", 8, 24): (0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    ("zb-1.5b", 8, 32): (0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    ("zb-1.5b", 8, 64): (0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    ("zb-6.2b", 8, 24): (0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    ("zb-6.2b", 8, 32): (0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    ("zb-6.2b", 8, 64): (0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    ("zb-14.6b", 16, 48): (0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    ("zb-14.6b", 16, 64): (0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    ("zb-14.6b", 16, 128): (0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    ("zb-28.3b", 32, 96): (0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    ("zb-28.3b", 32, 128): (0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    ("zb-28.3b", 32, 256): (0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
}

STP_REPORTED: dict[str, object] = {
    "claim": "up to +12% throughput over 1F1B-I / ZB-V for LLMs",
    "setting": {"model": "qwen2-12.1b", "tp": 8, "pp": 2, "sequence": 6144},
    "gain": 0.12,
    "source": "STP (arXiv 2510.27257), abstract and experiments; setting as stated in the issue",
}
"""The STP paper's headline LLM gain, the one the STP benchmark sets beside its
simulated throughput."""
