"""The per-rank parameter-version state machine, with the protocol's invariants as checks.

Versions count optimizer decisions: version v means the actions of iterations
0..v-1 have been applied. A rank that stepped provisionally on iteration k is
at version k+1 but not committed; one that deferred stays at k; validation
brings every rank to version k+1, committed. Every transition checks its
precondition and raises :class:`ProtocolError` (a bug in the caller, never
bad user input) when the seed's invariants would break:

1. conservative mode: no forward of k+1 before iteration k is validated;
2. speculative mode: at most one iteration is provisional at a time;
3. the optimizer runs only after every W of its iteration (nothing in flight);
4. only a rank that stepped can roll back;
5. checkpoints only from a validated, drained state.

(That a backward runs on its forward's version is checked per microbatch by
the executor, and "one version per microbatch along the pipeline" by the
message headers and the offline :mod:`zerobubble.trace.check`.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OptState(enum.StrEnum):
    """State of the newest optimizer decision of a rank."""

    NOT_STARTED = "not_started"
    """No iteration has reached its optimizer yet."""
    PROVISIONAL = "provisional"
    """Stepped or deferred on partial information; validation pending."""
    VALIDATED = "validated"
    """Final: the globally correct action is applied."""
    ROLLED_BACK = "rolled_back"
    """The provisional step was undone; the correct action is about to be applied."""


class ProtocolError(RuntimeError):
    """An invariant of the optimizer protocol was about to break (a bug, not bad input)."""


@dataclass
class RankVersions:
    """Where one rank stands.

    Attributes:
        speculative: Forwards of k+1 may run before k is validated.
        iteration: Iterations whose compute (F/B/W) has finished on this rank.
        param_version: Optimizer actions applied to the parameters (provisional or final).
        committed: Optimizer actions validated (final).
        opt: State of the newest optimizer decision.
        stepped: For a provisional decision: whether the rank stepped (else deferred).
    """

    speculative: bool = False
    iteration: int = 0
    param_version: int = 0
    committed: int = 0
    opt: OptState = OptState.NOT_STARTED
    stepped: bool | None = None

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise ProtocolError(f"{what} (state: {self})")

    def begin_compute(self, k: int) -> None:
        """Iteration k's first forward is about to run."""
        self._require(k == self.iteration, f"iteration {k} started out of order")
        if self.speculative:
            self._require(
                self.committed == k
                or (self.committed == k - 1 and self.opt is OptState.PROVISIONAL),
                f"iteration {k} started with more than one iteration unvalidated",
            )
        else:
            self._require(
                self.committed == k and self.opt in (OptState.NOT_STARTED, OptState.VALIDATED),
                f"forward of iteration {k} before iteration {k - 1} was validated",
            )

    def end_compute(self, k: int, in_flight: int) -> None:
        """Iteration k's program finished with ``in_flight`` microbatches still held by stages."""
        self._require(k == self.iteration, f"iteration {k} ended out of order")
        self._require(
            in_flight == 0,
            f"the optimizer of iteration {k} would run with {in_flight} microbatches whose W "
            "has not run",
        )
        self.iteration = k + 1

    def provisional(self, k: int, stepped: bool) -> None:
        """Stepped (or deferred) on iteration k's prefix state."""
        self._require(
            self.iteration == k + 1 and self.committed == k,
            f"provisional step of iteration {k} out of order",
        )
        self.opt, self.stepped = OptState.PROVISIONAL, stepped
        if stepped:
            self.param_version = k + 1

    def rollback(self, k: int) -> None:
        """The provisional step of iteration k was undone."""
        self._require(
            self.opt is OptState.PROVISIONAL and self.stepped is True and self.committed == k,
            f"rollback of iteration {k} on a rank that did not step provisionally",
        )
        self.opt, self.param_version = OptState.ROLLED_BACK, k

    def commit(self, k: int) -> None:
        """Iteration k's final action is applied (after validation, or directly)."""
        self._require(
            self.iteration >= k + 1 and self.committed == k,
            f"commit of iteration {k} out of order",
        )
        self.opt, self.stepped = OptState.VALIDATED, None
        self.param_version = self.committed = k + 1

    def require_drained(self) -> None:
        """Checkpoints see only validated state, with no iteration in flight."""
        self._require(
            self.opt in (OptState.NOT_STARTED, OptState.VALIDATED)
            and self.committed == self.iteration,
            "checkpoint requested outside a validated drain point (call drain() first)",
        )
