"""Activation offload in one process (pp = 1, no process group): bit-identical
results, stream-safety by fake asynchronous copies, honest byte counts.

The copies on the CPU are synchronous, so the ordering the CUDA path relies
on (wait for the copy in before the backward; free only after the copy out)
is checked with copiers whose copies run late: `Deferred` runs a copy only
when it is waited on (or polled often enough). In poison mode the offloader
overwrites released storages with 0xFF (NaN), so a read of an offloaded
activation shows in the results. Each safety test has a negative twin that
breaks the rule and must see the results change.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from stp.models import ModelConfig, StagePlacement, build_stage
from stp.runtime.executor import Executor
from stp.runtime.graph_saved import graph_saved
from stp.runtime.offload import ActivationOffloader, HostCopier, runtime_plan
from stp.schedule.lower import lower
from stp.schedule.registry import make as make_schedule

CONFIG = ModelConfig(
    vocab_size=32, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=64,
    max_seq_len=16, seed=3,
)
M, SEQ, MBS = 4, 8, 2


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tok = torch.randint(0, CONFIG.vocab_size, (M * MBS, SEQ + 1),
                        generator=torch.Generator().manual_seed(7))
    return list(tok[:, :-1].chunk(M)), list(tok[:, 1:].chunk(M))


def _run(
    name: str, policy: str | None, braid: bool = True, **kw
) -> tuple[dict, dict, ActivationOffloader | None]:
    """One iteration of schedule `name` on one pipeline rank (float64); `braid`:
    braided blocks unit by unit (stp.runtime.braid) or pass by pass."""
    sch = make_schedule(name, 1, M)
    stages = {s: build_stage(CONFIG, StagePlacement(s, sch.num_stages, dtype=torch.float64))
              for s in sch.stages_of(0)}
    off = None
    if policy is not None:
        off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, policy), **kw)
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, CONFIG.hidden),
                  dtype=torch.float64, offload=off, braid=braid)
    losses = ex.run(*_data())
    grads = {n: p.grad for st in stages.values() for n, p in st.named_parameters()}
    return losses, grads, off


def _same(a: tuple, b: tuple) -> bool:
    return set(a[0]) == set(b[0]) and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(
        torch.equal(a[1][n], b[1][n]) for n in a[1]
    )


_BASE: dict[tuple[str, bool], tuple] = {}


def _base(name: str, braid: bool = True) -> tuple:
    if (name, braid) not in _BASE:
        _BASE[(name, braid)] = _run(name, None, braid)
    return _BASE[(name, braid)]


# -- bit-identical ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stp", "zb-v", "1f1b", "1f1b-interleaved"])
@pytest.mark.parametrize("mode", ["free", "poison", "unbraided"])
def test_every_policy_is_bit_identical(name: str, mode: str) -> None:
    braid = mode != "unbraided"
    for policy in ("none", "stp", "all", "selective:0.3"):
        got = _run(name, policy, braid, poison=mode == "poison")
        assert _same(got, _base(name, braid)), (name, policy)
        off = got[2]
        assert off is not None and off.resident_bytes() == 0 == off.recount()
        planned = len(runtime_plan(make_schedule(name, 1, M), policy))
        assert (off.memory.offloaded_bytes > 0) == (planned > 0), (name, policy)
    # the V schedules really offload at pp = 1 (else the test above proves little)
    if name in ("stp", "zb-v"):
        assert len(runtime_plan(make_schedule(name, 1, M), "all")) > 0


def test_offload_lowers_the_resident_peak() -> None:
    none = _run("stp", "none")[2]
    stp = _run("stp", "stp")[2]
    assert none is not None and stp is not None
    assert stp.memory.peak_bytes < none.memory.peak_bytes
    # every forward kept something, and the stp policy moved chunk 0's
    assert all(b > 0 for b in none.memory.forward_bytes.values())
    assert stp.memory.offloaded_bytes == sum(
        b for (s, _), b in stp.memory.forward_bytes.items() if s == 0
    )


# -- stream safety with late copies ------------------------------------------------------


class _Late:
    """A copy that runs when waited on, or at the `lag`-th poll."""

    def __init__(self, fn: Callable[[], object], lag: int, lie: bool = False) -> None:
        self.fn, self.lag, self.lie, self.done = fn, lag, lie, False

    def run(self) -> None:
        if not self.done:
            self.fn()
            self.done = True

    def query(self) -> bool:
        self.lag -= 1
        if self.lag <= 0:
            self.run()
        return True if self.lie else self.done


class Deferred(HostCopier):
    """Copies out finish after `lag` polls, copies in when waited for."""

    def __init__(self, lag: int = 3, lag_in: int = 10**9, wait: bool = True,
                 lie: bool = False) -> None:
        self.lag, self.lag_in, self.waits, self.lie = lag, lag_in, wait, lie
        self.copies = 0

    def to_host(self, src):
        host = torch.UntypedStorage(src.nbytes())
        self.copies += 1
        return host, _Late(lambda: host.copy_(src), self.lag, self.lie)

    def to_device(self, dst, host):
        return _Late(lambda: dst.copy_(host), self.lag_in)

    def wait(self, event) -> None:
        if self.waits:
            event.run()

    def synchronize(self, event) -> None:
        event.run()


def _broken(name: str, policy: str, **kw) -> bool:
    """True if the run's results differ from the baseline (or it fails)."""
    try:
        return not _same(_run(name, policy, **kw), _base(name))
    except (RuntimeError, IndexError):
        return True


@pytest.mark.parametrize("name", ["stp", "zb-v"])
def test_late_copies_are_waited_for(name: str) -> None:
    for lag in (1, 2, 5, 50):
        copier = Deferred(lag=lag)
        got = _run(name, "all", copier=copier, poison=True)
        assert _same(got, _base(name)), lag
        assert copier.copies > 0


def test_skipping_the_wait_is_caught() -> None:
    """Negative twin: a backward that does not wait for its copy in reads poison."""
    assert _broken("stp", "all", copier=Deferred(lag=1, wait=False), poison=True)


def test_freeing_before_the_copy_out_ends_is_caught() -> None:
    """Negative twin: an event that says done before the copy ran lets the
    offloader release (poison) the storage early, and the host gets poison."""
    assert _broken("stp", "all", copier=Deferred(lag=3, lie=True), poison=True)


class Corrupting(HostCopier):
    """Flips every host copy's bytes: proves the reload's bytes are the ones used."""

    def to_host(self, src):
        host, event = super().to_host(src)
        view = torch.empty(0, dtype=torch.uint8).set_(host)
        view.copy_(view ^ 0x5A)
        return host, event


@pytest.mark.parametrize("poison", [False, True], ids=["free", "poison"])
def test_the_host_copy_is_what_comes_back(poison: bool) -> None:
    assert _broken("stp", "all", copier=Corrupting(), poison=poison)


# -- counting ----------------------------------------------------------------------------


def test_resident_bytes_is_recounted_after_every_pass() -> None:
    sch = make_schedule("zb-v", 1, M)
    stages = {s: build_stage(CONFIG, StagePlacement(s, sch.num_stages, dtype=torch.float64))
              for s in sch.stages_of(0)}
    off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, "all"))
    seen = []
    after = off.after_pass

    def check(p):
        after(p)
        seen.append((str(p), off.resident_bytes(), off.recount()))

    off.after_pass = check  # type: ignore[method-assign]
    ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, CONFIG.hidden),
                  dtype=torch.float64, offload=off)
    ex.run(*_data())
    assert all(a == b for _, a, b in seen), seen
    assert max(a for _, a, _ in seen) <= off.memory.peak_bytes
    assert off.memory.weight_bytes, "zb-v splits B and W: W keeps bytes"


def test_weight_gradients_hold_no_graph() -> None:
    """W's .grad must not carry autograd history: it would keep every
    microbatch's W inputs alive past W, unseen by the accounting."""
    _, grads, _ = _run("zb-v", "none")
    assert all(not g.requires_grad and g.grad_fn is None for g in grads.values())


def test_one_storage_is_counted_once_and_shared_tensors_never() -> None:
    """A toy stage: h and h.detach() share a storage (counted once); the
    parameter, the shared table and the step's data are not counted."""

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
            self.table = torch.randn(4, dtype=torch.float64)
            self.kept: dict[int, list[torch.Tensor]] = {}

        def kept_tensors(self, mb: int) -> list[torch.Tensor]:
            return self.kept.get(mb, [])

        def shared_tensors(self) -> list[torch.Tensor]:
            return [self.table]

    toy = Toy()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h = (x @ toy.w).tanh() * toy.table  # saves x (data), w, the tanh result, the table
    toy.kept[0] = [h, h.detach(), x]
    sch = make_schedule("1f1b", 1, 1)
    off = ActivationOffloader(sch, 0, {0: toy}, runtime_plan(sch, "none"))
    off.start([x], [])
    forward = sch.actions[0][0]
    off.before_action(forward)
    off.after_pass(forward)  # type: ignore[arg-type]
    # distinct storages: h (= h.detach()) and the tanh output
    tanh_out = h.grad_fn.next_functions[0][0]._saved_result
    want = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in (h, tanh_out)}
    saved = {id(t.untyped_storage()) for t in graph_saved([h])}
    for shared in (toy.table, toy.w, x):  # found, then left out
        assert id(shared.untyped_storage()) in saved
    assert off.resident_bytes() == sum(want.values()) == off.recount()


# -- errors and GPU ------------------------------------------------------------------------


def test_bad_policy_and_stage_are_refused() -> None:
    sch = make_schedule("stp", 1, M)
    with pytest.raises(ValueError, match="selective:X"):
        runtime_plan(sch, "most")
    with pytest.raises(ValueError, match="kept_tensors"):
        ActivationOffloader(sch, 0, {0: object(), 1: object()}, runtime_plan(sch, "all"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_side_streams_bit_identical_and_bytes_leave() -> None:
    sch = make_schedule("stp", 1, M)
    out = {}
    for policy in ("none", "all"):
        stages = {s: build_stage(CONFIG, StagePlacement(s, sch.num_stages, dtype=torch.float32,
                                                        device="cuda"))
                  for s in sch.stages_of(0)}
        off = ActivationOffloader(sch, 0, stages, runtime_plan(sch, policy), device="cuda")
        ex = Executor(lower(sch), 0, stages, None, boundary_shape=(MBS, SEQ, CONFIG.hidden),
                      dtype=torch.float32, device="cuda", offload=off)
        inputs, targets = _data()
        losses = ex.run([t.cuda() for t in inputs], [t.cuda() for t in targets])
        torch.cuda.synchronize()
        grads = {n: p.grad.cpu() for st in stages.values() for n, p in st.named_parameters()}
        out[policy] = ({k: v.cpu() for k, v in losses.items()}, grads, off.memory)
    assert _same(out["none"], out["all"])
    assert out["all"][2].peak_bytes < out["none"][2].peak_bytes
