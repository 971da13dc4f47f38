"""The mixture-of-experts family's pricing: a decoder whose MLP routes tokens to
experts (`spec`: its shape, all-to-all and the decoder hooks it overrides;
`configs`: its spec from a run's config or a config.json); `pricing` is its row of
the family table (stp.costmodel.families)."""
