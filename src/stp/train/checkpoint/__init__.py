"""Checkpoints: sharded DCP checkpoints any mesh resumes from (`sharded`,
`shards`, `resume`), read without running code (`read`), checksummed
(`integrity`), storage faults told in one line (`storage`), and the whole model
as one file (`save_full`, `gather`).

This package imports nothing itself.
"""
