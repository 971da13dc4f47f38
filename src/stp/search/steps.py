"""The steps of one search (`stp.search.entry.search`), over one pool of scored
candidates and one deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from stp.schedule.ir import Block, Kind, Pass, Schedule
from stp.schedule.memory import MemCosts, peak_by_order
from stp.schedule.validate import validate
from stp.search.greedy import build
from stp.search.local import braid_pass, refine_caps
from stp.search.moves import improve
from stp.search.replay import Player, exact_for
from stp.search.space import Policy, placement, policies, warmup_caps
from stp.search.vshape import candidates as v_shape_candidates
from stp.search.zbv import cost_aware_v_variants
from stp.sim.costs import Costs
from stp.sim.engine import simulate
from stp.sim.result import SimResult
from stp.sim.stages import StageCostsFor

__all__ = ["Candidate", "Run", "sim_score"]

_EPS = 1e-9
Score = tuple[float, float]
Best = dict[str, tuple["Candidate", Policy, tuple[int, ...]]]

SHARES = {"v": 0.33, "greedy": 0.6, "refine": 0.7, "all": 1.0}
"""By which fraction of the usable time (from the end of the handcrafted
seeds to the time limit less `Run.reserve`) each step stops if it has not
finished (V constructions, greedy grid, cap refinement, everything): a step
that finishes early leaves its time to the next ones, the local search
last."""


@dataclass
class Candidate:
    score: Score
    origin: str
    schedule: Schedule


def _score(makespan: float, span: float, objective: str) -> Score:
    return (makespan, span) if objective == "makespan" else (span, makespan)


def sim_score(res: SimResult, objective: str) -> Score:
    return _score(res.makespan, res.critical_rank.span, objective)


def _has_blocks(sch: Schedule) -> bool:
    return any(isinstance(a, Block) for acts in sch.actions for a in acts)


@dataclass
class Run:
    """One search: its inputs, its deadline and the pool of scored candidates.
    Each method is one step of the method in `stp.search.entry`."""

    p: int
    m: int
    costs: Costs
    mem: MemCosts
    limit: float
    objective: str
    layers: int
    braid: bool
    kinds: list[tuple[str, int]]
    """(placement, chunks) pairs the search may use."""
    started: float
    time_limit: float
    pool: list[Candidate] = field(default_factory=list)
    evaluated: int = 0
    converged: bool = True
    """False once a step was cut short by the deadline."""
    stage_costs: StageCostsFor | None = None
    """Per-stage cost tables by stage count (`stp.sim.stages`); None: uniform."""
    steps_from: float = 0.0
    """When the steps after the handcrafted seeds began (`SHARES` divide the
    time from there to the limit less `reserve`); 0: from `started`."""
    reserve: float = 0.0
    """Seconds kept at the end of the time limit for what cannot be cut short:
    the final validation and simulation, and the step under way when time
    runs out (`stp.search.entry.search` sets it from how long the handcrafted
    schedules took to simulate on this machine, at least 10% of the limit)."""

    def simulate(self, sch: Schedule) -> SimResult:
        """The simulated run of `sch` under the search's costs (per stage when given)."""
        stages = None if self.stage_costs is None else self.stage_costs(sch.num_stages)
        return simulate(sch, self.costs, self.mem, self.layers, record_spans=False,
                        stages=stages)

    def _staged_score(self, sch: Schedule) -> Score:
        """Score under per-stage costs; a per-stage peak over the limit never wins."""
        res = self.simulate(sch)
        if max(res.peak_activation) > self.limit + _EPS:
            return (float("inf"), float("inf"))
        return sim_score(res, self.objective)

    def until(self, step: str) -> Callable[[], bool]:
        """The out-of-time test of a step (`SHARES`); a step cut short marks
        the search as not converged."""
        begin = self.steps_from or self.started
        end = self.started + self.time_limit - self.reserve
        stop = begin + SHARES[step] * (end - begin)

        def out() -> bool:
            if time.perf_counter() > stop:
                self.converged = False
                return True
            return False

        return out

    def out_of_time(self) -> bool:
        return self.until("all")()

    def score(self, sch: Schedule) -> Score:
        """The objective's score of a schedule: the fast timeline where it is
        the simulator's, else the simulator."""
        self.evaluated += 1
        if self.stage_costs is not None:
            return self._staged_score(sch)
        if exact_for(sch, self.costs, self.layers):
            tl = Player(sch, self.costs).play(sch.actions)
            assert tl is not None, "a constructed schedule deadlocks"
            first = [next((tl.start[r][k] for k, a in enumerate(acts)
                           if isinstance(a, Pass) and a.kind is Kind.F), 0.0)
                     for r, acts in enumerate(sch.actions)]
            span = max(tl.rank_end(r) - first[r] for r in range(sch.num_ranks))
            return _score(tl.makespan, span, self.objective)
        res = simulate(sch, self.costs, self.mem, self.layers, record_spans=False)
        return sim_score(res, self.objective)

    def add(self, sch: Schedule, origin: str) -> Candidate:
        cand = Candidate(self.score(sch), origin, sch)
        self.pool.append(cand)
        return cand

    def evaluate(self, pl: tuple[int, ...], pol: Policy) -> Candidate | None:
        """Build one greedy schedule and score it (not added to the pool)."""
        built = build(pl, self.m, self.costs, self.mem, self.limit, pol)
        if built is None:
            return None
        self.evaluated += 1
        if self.stage_costs is not None:
            score = self._staged_score(built.schedule)
        elif built.exact and self.layers == 1:  # the greedy's timeline is the simulator's
            score = _score(built.makespan, built.max_span, self.objective)
        else:
            res = simulate(built.schedule, self.costs, self.mem, self.layers,
                           record_spans=False)
            score = sim_score(res, self.objective)
        return Candidate(score, pol.label(), built.schedule)

    def seed(self, scored: list[tuple[str, Schedule, SimResult]]) -> None:
        """Step 1: handcrafted schedules that fit the limit and the space."""
        for name, sch, res in scored:
            self.pool.append(Candidate(sim_score(res, self.objective), f"handcrafted {name}",
                                       sch))
            self.evaluated += 1

    def greedy_grid(self) -> Best:
        """Step 2: the policy grid, placements interleaved so a short time limit
        covers both; returns the best candidate of each placement."""
        grids = []
        for kind, v in self.kinds:
            pl = placement(kind, self.p, v)
            caps = warmup_caps(pl, self.costs)
            grids.append([(kind, pl, replace(pol, cap=cap))
                          for pol in policies(chunks=v, braid=self.braid)
                          for cap in (caps, None)])
        order = [g[i] for i in range(max(map(len, grids))) for g in grids if i < len(g)]
        best: Best = {}
        out_of_time = self.until("greedy")
        for kind, pl, pol in order:
            if out_of_time() and self.pool:
                break
            cand = self.evaluate(pl, pol)
            if cand is None:
                continue
            cand.origin = f"greedy {kind}: {cand.origin}"
            self.pool.append(cand)
            if kind not in best or cand.score < best[kind][0].score:
                best[kind] = (cand, pol, pl)
        return best

    def v_constructions(self) -> None:
        """Step 3 (V placement): ZB-V built from the costs, then the V-shape
        building blocks that fit the limit, best-ranked first."""
        if ("v", 2) not in self.kinds:
            return
        out_of_time = self.until("v")
        for origin, sch in cost_aware_v_variants(self.p, self.m, self.costs, self.mem,
                                                 self.limit, out_of_time):
            self.add(sch, origin)
        for origin, sch in v_shape_candidates(self.p, self.m, self.mem, self.limit,
                                              out_of_time):
            self.add(sch, origin)

    def braid_best(self) -> None:
        """Step 4a: braid the best unbraided orders (a TP all-reduce to hide)."""
        self.pool.sort(key=lambda c: c.score)
        out_of_time = self.until("refine")
        for cand in self.pool[:3]:
            if out_of_time():
                break
            self.braid_one(cand)

    def braid_one(self, cand: Candidate) -> None:
        if _has_blocks(cand.schedule):
            return
        braided = braid_pass(cand.schedule, self.costs, self.mem, self.limit, self.layers)
        if braided is not None:
            self.add(braided, cand.origin + " + braided")

    def refine_caps(self, best_by_kind: Best) -> None:
        """Step 4b: coordinate descent on the per-rank caps from the best greedy
        of each placement, best placement first."""
        out_of_time = self.until("refine")
        for kind, (cand, pol, pl) in sorted(best_by_kind.items(), key=lambda kv: kv[1][0].score):
            if out_of_time():
                break

            def scalar(trial: Policy, pl: tuple[int, ...] = pl) -> float | None:
                got = self.evaluate(pl, trial)
                return None if got is None else got.score[0] + 1e-12 * got.score[1]

            first = cand.score[0] + 1e-12 * cand.score[1]
            refined, _ = refine_caps(pol, pol.cap or warmup_caps(pl, self.costs), first,
                                     scalar, out_of_time)
            if refined.cap != pol.cap:
                got = self.evaluate(pl, refined)
                if got is not None:
                    got.origin = f"greedy {kind}: {got.origin} (caps refined)"
                    self.pool.append(got)

    def local_search(self) -> None:
        """Step 5: hill-climb (`stp.search.moves`) from the best candidate of
        each construction (handcrafted, greedy per placement, V-shape block,
        cost-aware ZB-V, braided), best first, each until no move improves
        it or time runs out; braid what improved (ar > 0)."""
        for cand in self._starts():
            if self.out_of_time():
                return
            stages = (None if self.stage_costs is None
                      else self.stage_costs(cand.schedule.num_stages))
            got = improve(cand.schedule, self.costs, self.mem, self.limit, self.objective,
                          self.out_of_time, layers=self.layers, stages=stages)
            self.evaluated += got.evaluated
            if got.moves:
                better = self.add(got.schedule, f"{cand.origin} + {got.moves} moves")
                if self.braid and self.costs.tp_time > 0 and not self.out_of_time():
                    self.braid_one(better)

    def _starts(self) -> list[Candidate]:
        """The best candidate of each construction family, best first."""
        self.pool.sort(key=lambda c: c.score)
        seen: set[str] = set()
        out = []
        for cand in self.pool:
            family = cand.origin.split(":")[0].split(" (")[0].split(" block")[0]
            family += " braided" if _has_blocks(cand.schedule) else ""
            if family not in seen:
                seen.add(family)
                out.append(cand)
        return out

    def winner(self) -> tuple[Schedule, str]:
        """The best candidate, renamed `search`, validated against the limit."""
        self.pool.sort(key=lambda c: c.score)
        origin, best = self.pool[0].origin, self.pool[0].schedule
        best = replace(best, name="search", meta={**best.meta, "origin": origin,
                                                   "memory_limit": self.limit,
                                                   "objective": self.objective})
        if self.pool[0].score[0] == float("inf"):
            raise ValueError(f"no schedule found whose per-stage peak activation fits the "
                             f"memory limit {self.limit:g}; raise --memory-limit")
        if self.stage_costs is not None:  # judged per stage (_staged_score)
            validate(best)
            return best, origin
        validate(best, memory_limit=self.limit, mem=self.mem)
        assert max(peak_by_order(best, self.mem)) <= self.limit + _EPS
        return best, origin
