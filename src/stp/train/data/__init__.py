"""Training data: the byte-level corpus and deterministic batches (`corpus`),
tokenised text packed into sequences (`tokens`), image-caption pairs for the
multimodal model (`images`).

This package imports nothing itself.
"""
