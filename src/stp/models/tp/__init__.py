"""Tensor-parallel layers and collectives with the all-reduces left to the caller,
and the deferred weight-gradient store of the split backward."""

from stp.models.tp.comm import (
    AllReduce,
    PendingAllReduce,
    identity_allreduce,
    make_allreduce,
    start_allreduce,
)
from stp.models.tp.layers import (
    linear,
    rms_norm,
    vocab_ce_finish,
    vocab_ce_grad,
    vocab_ce_stats,
    vocab_embedding_partial,
)
from stp.models.tp.wgrad import WGradStore

__all__ = [
    "AllReduce",
    "PendingAllReduce",
    "identity_allreduce",
    "make_allreduce",
    "start_allreduce",
    "linear",
    "rms_norm",
    "vocab_embedding_partial",
    "vocab_ce_stats",
    "vocab_ce_finish",
    "vocab_ce_grad",
    "WGradStore",
]
