"""The multimodal family's pricing: a vision encoder in front of a decoder (`spec`:
its shape and the encoder's formulas; `costs`: per-stage time costs; `memory`: its
bytes per rank); `pricing` is its row of the family table (stp.costmodel.families)."""
