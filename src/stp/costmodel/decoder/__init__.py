"""The decoder family's pricing: its spec (`spec`), time costs (`costs`), what its
units keep (`kept`), its bytes per rank (`memory`) and its spec from a run's config
(`configs`); `pricing` is its row of the family table (stp.costmodel.families).
A mixture of experts and the multimodal model build on these formulas."""
