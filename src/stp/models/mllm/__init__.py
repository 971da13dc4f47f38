"""The multimodal family: a ViT-style vision encoder in front of the decoder
(its shape: `stp.shapes.MLLMConfig`).

- `vision`: the encoder's units and the patch merger; `stage`: one stage on one
  TP rank (`build_mllm_stage`); `reference`: the whole model in one process;
  `family`: the family's verbs (`MLLM`, stp.models.family).
"""
