"""The settings of one `stp train` run: plain, picklable data, no torch.

`TrainJob` is the one source of truth for `stp train`'s options: the CLI
derives every flag, default and help text from these fields
(`stp.cli.flags`), so a new setting is one field here. The checks that need
torch (the model against the mesh, the data) live in `stp.train.run.job`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stp.costmodel.decoder.spec import RECOMPUTE_MODES
from stp.train.families.registry import MODULES as FAMILY_MODULES

__all__ = ["ARCHS", "DEFAULT_LR", "DTYPES", "LR_SCHEDULES", "TOY_SHAPE", "MoEShape", "ModelShape",
           "TrainJob", "VisionShape", "default_lr", "option"]

DTYPES = ("float32", "float64", "bfloat16")
LR_SCHEDULES = ("constant", "cosine", "linear")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    short: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line option: `help` is its help
    text; `minimum` (inclusive) or `above` (exclusive) bound a number; `flag`
    overrides the `--field-name` spelling; `short` adds a one-letter alias."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "choices": choices,
            "minimum": minimum, "above": above, "maximum": maximum, "short": short}
    return field(default=default, metadata=meta)


TOY_SHAPE = {"layers": 4, "hidden": 64, "heads": 4}
"""stp's own model when the shape flags are left out (stp.train.run.job.model_config)."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of stp's own decoder (Llama/Qwen2-style, byte-level vocabulary). A
    field left None takes TOY_SHAPE's value, or with --init-from the checkpoint's
    (a field given must then agree with it)."""

    layers: int | None = option(None, "transformer layers (default 4, or the --init-from "
                                "checkpoint's)", minimum=1, maximum=1024)
    hidden: int | None = option(None, "model width (default 64, or the checkpoint's)",
                                minimum=1, maximum=2**17)
    heads: int | None = option(None, "attention heads (default 4, or the checkpoint's)",
                               minimum=1, maximum=1024)
    kv_heads: int | None = option(None, "key/value heads (default: as many as --heads, or "
                                  "the checkpoint's)", minimum=1, maximum=1024)
    seq_len: int = option(64, "tokens per sequence", minimum=1, maximum=2**20)


ARCHS = tuple(FAMILY_MODULES)
"""The model families `--arch` names (the registry, stp.train.families)."""


@dataclass(frozen=True)
class VisionShape:
    """The vision encoder of `--arch mllm` (stp.shapes.mllm.VisionConfig): images
    of image_size**2 pixels cut into patch x patch patches, merge x merge of them one
    decoder token placed before the caption's --seq-len tokens."""

    image_size: int = option(32, "--arch mllm: image side in pixels", minimum=1, maximum=4096)
    patch: int = option(4, "--arch mllm: patch side in pixels", minimum=1, maximum=256)
    merge: int = option(2, "--arch mllm: merge x merge patches make one image token",
                        minimum=1, maximum=8)
    vision_layers: int = option(2, "--arch mllm: vision encoder blocks (counted with --layers "
                                "by --partition, encoder first)", minimum=1, maximum=1024)
    vision_hidden: int = option(16, "--arch mllm: vision encoder width (merge**2 x it must "
                                "not exceed --hidden)", minimum=1, maximum=2**16)
    vision_heads: int = option(2, "--arch mllm: vision encoder attention heads", minimum=1,
                               maximum=1024)


@dataclass(frozen=True)
class MoEShape:
    """The experts of `--arch moe` (stp.shapes.moe.MoEConfig; an --init-from Qwen2-MoE or
    Mixtral checkpoint brings its own)."""

    experts: int = option(4, "--arch moe: routed experts per MoE layer", minimum=1,
                          maximum=1024)
    top_k: int = option(2, "--arch moe: experts each token goes to (at most --experts)",
                        minimum=1, maximum=1024)
    expert_ffn: int | None = option(None, "--arch moe: inner width of one expert (default: "
                                    "the dense MLP's / --top-k)", minimum=1, maximum=2**20)
    shared_expert_ffn: int = option(0, "--arch moe: inner width of a shared expert with a "
                                    "sigmoid gate (Qwen2-MoE); 0: none", minimum=0,
                                    maximum=2**20)
    moe_every: int = option(1, "--arch moe: every N-th layer routes its MLP (the others are "
                            "dense)", minimum=1, maximum=1024)
    aux_loss_coef: float = option(0.001, "--arch moe: weight of the load-balancing loss in "
                                  "the objective", minimum=0, maximum=1000)


@dataclass(frozen=True)
class TrainJob:
    """Everything one training run needs; defaults are the `stp train` defaults."""

    schedule: str = option("stp", "pipeline schedule: a name (see `stp schedules`) or a schedule "
                           "file FILE.json|FILE.csv (`stp search --out`, `stp export`), checked "
                           "against the mesh", metavar="NAME|FILE")
    partition: str | None = option(
        None, "transformer layers per global stage, L0,L1,.. (summing to the model's layers), "
        "or auto (balanced by the cost model, judged by the simulator); default: the even "
        "split", metavar="auto|L0,L1,..")
    pp: int = option(2, "pipeline ranks", minimum=1, maximum=64)
    tp: int = option(1, "tensor-parallel ranks", minimum=1, maximum=1024)
    dp: int = option(1, "data-parallel replicas", minimum=1, maximum=65536)
    ep: int = option(1, "expert-parallel ranks (--arch moe), carved from the --dp ranks "
                     "(Megatron-LM's arrangement: --ep divides --dp, --ep consecutive DP "
                     "ranks share the experts, each holding --experts / --ep of them)",
                     minimum=1, maximum=65536)
    microbatches: int | None = option(
        None, "microbatches per step (default 8, or 2 pp when larger); the global batch is "
        "dp x m x microbatch size", minimum=1, maximum=4096, short="-m")
    """m; None: 8, or 2 pp when larger. A fixed default keeps the global batch, hence
    the losses, the same for pp = 1, 2, 4."""
    microbatch_size: int = option(4, "sequences per microbatch", minimum=1, maximum=2**16)
    model: ModelShape = field(default_factory=ModelShape)
    arch: str = option("decoder", "the model: decoder (text), mllm (a vision encoder in "
                       "front of the decoder, trained on image captions; --seq-len is then "
                       "the caption's tokens), or moe (the decoder with routed experts); "
                       "an --init-from checkpoint's config.json decides it", choices=ARCHS)
    vision: VisionShape = field(default_factory=VisionShape)
    moe: MoEShape = field(default_factory=MoEShape)
    images: str | None = option(
        None, "--arch mllm: a directory of PNG/JPEG images with captions.txt ('FILE<TAB>"
        "caption' lines); default: coloured shapes drawn from --seed", metavar="DIR")
    steps: int = option(200, "optimizer steps", minimum=1)
    lr: float | None = option(
        None, "AdamW learning rate (default 3e-3 x min(1, 256 / hidden), hidden being the "
        "width of the model trained, an --init-from checkpoint's too: 3e-3 up to hidden 256, "
        "7.5e-4 at 1024, 1.875e-4 at 4096, where 3e-3 diverged)", above=0,
        maximum=10)
    """None until resolved: stp.train.run.resolve fills in `default_lr` of the model's width."""
    seed: int = option(0, "init and data seed", minimum=0)
    dtype: str = option("float32", "compute dtype; bfloat16 keeps fp32 master weights, main "
                        "grads and optimizer state", choices=DTYPES)
    lr_schedule: str = option("constant", "learning rate after the warm-up: constant, or cosine / "
                              "linear decay to --min-lr at --steps", choices=LR_SCHEDULES)
    warmup: int = option(0, "updates of linear learning-rate warm-up", minimum=0)
    min_lr: float = option(0.0, "learning rate at the end of the decay", minimum=0)
    weight_decay: float = option(0.0, "AdamW weight decay (not on norm gains and biases)",
                                 minimum=0)
    clip_grad: float | None = option(
        None, "clip the global gradient norm (every stage, TP shard and DP replica) to X; "
        "default: no clipping, the norm is still reported", above=0)
    data: str | None = option(
        None, "a text file or directory, a Megatron dataset PREFIX, a flat token file "
        "*.bin, *.jsonl, *.parquet, a save_to_disk directory, or a mixture W1:PATH1,"
        "W2:PATH2 (default: the Python standard library; docs/data.md)",
        metavar="PATH")
    model_name: str | None = option(
        None, "a randomly initialised model at a named shape: a preset (qwen2-12.1b, "
        "llama3-405b, mixtral-8x7b, ...; with ,key=val fields) or a Hugging Face config.json "
        "(or its directory); its vocabulary is kept, data without --tokenizer trains on bytes; "
        "with --init-from the weights come from DIR and --model must match its shape",
        flag="--model", metavar="PRESET|config.json")
    init_from: str | None = option(
        None, "start from a Hugging Face Llama / Qwen2 checkpoint directory (config.json + "
        "*.safetensors): every rank reads only its slices; the model's shape is its "
        "config.json's", metavar="DIR")
    save_hf: str | None = option(
        None, "after the last step, write the model as a Hugging Face checkpoint directory "
        "(transformers' from_pretrained loads it)", metavar="DIR")
    save_full: str | None = option(
        None, "after the last step, write the whole model as one safetensors file under the "
        "single-process model's names, stage by stage (no rank gathers the model); its "
        "directory is checked writable before training", metavar="PATH")
    tokenizer: str | None = option(
        None, "tokenizer.json that tokenises --data (default: the --init-from directory's, "
        "when it has one; else bytes)", metavar="PATH")
    out: str | None = option(None, "checkpoint directory, created and checked writable before "
                             "training (default runs/train-<time>/)", metavar="DIR")
    save_every: int = option(0, "write a sharded checkpoint into --out every N steps (and after "
                             "the last step); 0: after the last step only", minimum=0)
    keep: int | None = option(None, "keep only the K newest checkpoints in --out (default: all)",
                              minimum=1, metavar="K")
    resume: str | None = option(
        None, "continue from the latest complete checkpoint in DIR, whatever mesh and schedule "
        "wrote it (same step numbers; --steps is the total)", metavar="DIR")
    allow_unverified: bool = option(
        False, "with --resume: accept a checkpoint that has no stp.sha256.json (one written "
        "before stp wrote checksums); its bytes are then not checked for damage")
    eval_every: int = option(0, "every N steps, the mean loss on --eval-data, or with --arch "
                             "mllm on held-out images (0: never)", minimum=0)
    eval_data: str | None = option(None, "held-out text file or directory for --eval-every",
                                   metavar="PATH")
    eval_images: str | None = option(
        None, "--arch mllm: held-out images for --eval-every, a directory like --images "
        "(needed with --images); default: generated shapes from a stream the training never "
        "draws from", metavar="DIR")
    max_skipped_steps: int = option(
        10, "stop (exit 1) after N consecutive steps whose gradients hold inf/NaN (their "
        "updates are skipped); 0: never stop", minimum=0, metavar="N")
    memory_budget: str | None = option(
        None, "bytes one device may hold (plain bytes, or 80GB / 80GiB): a run whose estimated "
        "peak rank (`stp memory`) exceeds it is refused before any worker starts; default: "
        "the ranks of this machine must fit its available memory", metavar="SIZE")
    timeout: float = option(
        120.0, "seconds a rank may wait on a peer before all ranks stop", above=0)
    offload: str = option(
        "none", "activation offload: none, stp (the STP paper's: chunk-0 activations), all, "
        "selective:X (PipeOffload: cut the peak by about X). Every policy measures resident "
        "activation bytes per rank", metavar="POLICY")
    braid: bool = option(
        True, "run braided blocks unit by unit with the TP all-reduces in flight; off: pass "
        "by pass, every all-reduce waited for")
    sequence_parallel: bool = option(
        False, "Megatron-style sequence parallelism (arXiv 2205.05198): between TP regions "
        "each TP rank holds --seq-len / --tp rows; reduce-scatter and all-gather replace "
        "the all-reduce (--seq-len must divide by --tp; no effect at --tp 1)")
    tp_overlap: bool = option(
        False, "in-layer TP overlap (async TP, as Megatron-LM's --tp-comm-overlap): each TP "
        "region's all-gather and reduce-scatter cut into --tp-overlap-chunks pieces along "
        "the sequence, each under the next piece's matmul (needs --sequence-parallel; no "
        "effect at --tp 1; the decoder family only)")
    tp_overlap_chunks: int = option(
        4, "chunks of --tp-overlap: each TP rank's --seq-len / --tp rows must divide by it",
        minimum=1, metavar="K")
    shard_optimizer: bool = option(
        False, "ZeRO stage 1 (arXiv 1910.02054): fp32 master weights and AdamW moments split "
        "over the --dp ranks, gradients reduce-scattered and parameters all-gathered instead "
        "of one all-reduce; checkpoints resume with or without it, on any --dp (no effect "
        "at --dp 1)")
    overlap_grad_sync: bool = option(
        True, "launch each stage's DP gradient all-reduce (reduce-scatter with "
        "--shard-optimizer) as soon as its last weight gradient is done, under the rest "
        "of the pipeline (Megatron-LM's --overlap-grad-reduce); off: all of them after "
        "the pipeline drains. The same losses and gradients either way")
    overlap_param_gather: bool = option(
        False, "with --shard-optimizer: launch each stage's parameter all-gather after the "
        "optimizer step and wait for it only before that stage's first forward of the next "
        "step (Megatron-LM's --overlap-param-gather); off: all of them right after the step, "
        "exposed. The same losses and parameters either way (no effect without "
        "--shard-optimizer or at --dp 1)")
    recompute: str = option(
        "none", "activation recomputation: none, selective (the attention core again in the "
        "backward), full (each unit keeps its input only and runs its forward again in the "
        "backward); the same losses and gradients, less activation memory",
        choices=RECOMPUTE_MODES)
    compile: bool = option(
        False, "torch.compile (inductor) the pieces between each unit's linears: norms, "
        "rotary, SwiGLU, the loss; linears, the deferred weight gradients, braiding, offload "
        "and recomputation as without it (docs/compile.md). The first step compiles; "
        "compile seconds are reported apart from step times")
    hardware: str | None = option(
        None, "the device the MFU is measured against: h100, h100-pcie, h100-nvl, h200, "
        "h200-nvl, a100, a800 (or stp plan's a100-80g, a800-80g, h100-80g), or its dense peak "
        "for --dtype in FLOP/s (e.g. 989e12); default: torch.cuda.get_device_name() in that "
        "table, none on the CPU (mfu null). MFU counts the model's FLOPs as stp plan does: "
        "matmuls, causal attention counted full, recomputation not counted",
        metavar="NAME|FLOPS")
    trace: str | None = option(
        None, "write the last step's measured trace (every unit, all-reduce, send and "
        "receive of every rank; open in ui.perfetto.dev)", metavar="FILE.json")
    emulate: str | None = option(
        None, "replace each unit's compute by a timed wait: milliseconds of F, B, W per "
        "microbatch per rank share, as `stp simulate --cost`; communication stays real "
        "(the loss is not computed)", flag="--emulate-compute", metavar="f=..,b=..,w=..")
    plan: str | None = option(
        None, "run plan #1 of `stp plan --out PLAN.json`: its model, mesh, schedule, "
        "partition, microbatching, sequence length, dtype and memory levers (a flag given "
        "too must agree with it)", metavar="PLAN.json")
    document_mask: bool = option(
        False, "attend only within each document of the packed rows, restart positions at "
        "each document start, train no prediction across a boundary (documents end at the "
        "tokenizer's EOS id; needs tokenised data: --tokenizer or --init-from)")
    log: str = option(
        "jsonl", "where the step figures go besides the terminal: jsonl (metrics.jsonl in "
        "--out, always written) or tensorboard (also TensorBoard event files in "
        "--out/tensorboard; pip install 'stp[log]')", choices=("jsonl", "tensorboard"))
    # data formats, mixtures and resume on changed data (stp.train.data)
    data_format: str | None = option(
        None, "read --data as this format instead of detecting it: megatron (PREFIX.idx + "
        ".bin), tokens (a flat token file), jsonl, chat (JSONL conversations through the "
        "tokenizer's chat template), parquet, hf (a save_to_disk directory), text "
        "(docs/data.md)", choices=("megatron", "tokens", "jsonl", "chat", "parquet", "hf",
                                   "text"), metavar="FORMAT")
    data_column: str = option("text", "the text column of JSONL / Parquet / save_to_disk "
                              "data", metavar="NAME")
    token_dtype: str = option("uint16", "id type of a flat token file: uint16 (nanoGPT's "
                              "train.bin), uint32 for vocabularies over 65,535",
                              choices=("uint16", "uint32"))
    eos_id: int | None = option(None, "the id that separates documents in a flat token file "
                                "(default: the tokenizer's EOS)", minimum=0, metavar="ID")
    data_changed_ok: bool = option(
        False, "with --resume: go on although --data is not the data the run trained on "
        "(its batches then differ from the uninterrupted run's)")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else max(8, 2 * self.pp)

    @property
    def global_batch(self) -> int:
        """Sequences per step over all replicas: dp x m x microbatch size."""
        return self.dp * self.num_microbatches * self.microbatch_size

    def out_dir(self) -> Path:
        """--out, or else a new directory `runs/train-<time>` (`-2`, `-3`, ... when that
        exists: two runs started in the same second get two directories). The default
        is created here, so call once and keep the result (`stp train` stores it in
        `out` before any worker starts)."""
        if self.out is not None:
            return Path(self.out)
        return new_run_dir(Path("runs"), time.strftime("train-%Y%m%d-%H%M%S"))


DEFAULT_LR = 3e-3
"""The learning rate of the toy models (hidden <= LR_WIDTH)."""
LR_WIDTH = 256
"""Above this width the default learning rate falls as 1 / hidden (Adam's update of a
matmul's weights moves its output in proportion to the fan-in, so a fixed rate that
suits width 64 diverges at 4096: loss 6.5 -> 32 by step 3 on an H200)."""


def default_lr(hidden: int) -> float:
    """`--lr` left out: 3e-3 x min(1, 256 / hidden)."""
    return DEFAULT_LR * min(1.0, LR_WIDTH / hidden)


def new_run_dir(root: Path, name: str) -> Path:
    """Create and return `root/name`, or the first of `root/name-2`, `-3`, ... that
    did not exist (mkdir is atomic: two processes never get the same directory).
    ValueError when `root` cannot take a new directory."""
    n = 1
    while True:
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
        except OSError as e:
            raise ValueError(f"cannot create a run directory in {str(root)!r}: "
                             f"{e.strerror or e}; give --out DIR") from None
