"""The decoder family: a Llama / Qwen2-style decoder (its shape:
`stp.shapes.ModelConfig`) with tensor-parallel layers, cut into units at its
TP all-reduces and into pipeline stages with a split (B / W) backward.

- `units`: the units (embedding, attention, MLP, loss head); `chunk`: a stage's
  layers fused into one unit at one TP rank; `stage`: one stage on one TP rank
  (`build_stage`); `init`: mesh-independent initialisation; `rope`: rotary
  embeddings; `stage_shards`: whole parameters from their TP shards;
  `shared_grads`: tied and replicated parameters; `reference`: the whole model
  in one process; `family`: the family's verbs (`DECODER`, stp.models.family).
"""
