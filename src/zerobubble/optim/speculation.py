"""The optimizer's protocol as instructions and hooks for the plain executor.

The executor (:mod:`zerobubble.executor`) only interprets a program. What
post-validation needs on top of the lowered schedule is inserted by the builder's
protocol pass (:func:`~zerobubble.program.passes.protocol.insert_protocol`, asked for with
:meth:`~zerobubble.executor.PipelineExecutor.set_protocol`): a
:class:`~zerobubble.program.instructions.VersionCheck` before every compute and, for
speculative mode, the :class:`~zerobubble.program.instructions.Gate` of
:func:`~zerobubble.program.passes.protocol.plan_gates` (receive posts moved, what a replay
drains named); a schedule whose ranks cannot reach their gates is refused there,
before any message. Here:

* :class:`VersionGuard`: the hooks behind those instructions. Every B/W runs on
  its F's parameter version; speculative messages carry a version header
  (:mod:`~zerobubble.runtime.p2p.wire`) so stale ones are told from fresh ones, and
  work kept at the gate must have seen one version.
"""

from __future__ import annotations

import torch

from zerobubble.executor import PipelineExecutor
from zerobubble.program.instructions import Message
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.p2p.comm import TensorMeta
from zerobubble.runtime.p2p.wire import Header, pack, packed_meta, unpack
from zerobubble.schedule.ir import Action, Op

__all__ = ["VersionGuard"]


class VersionGuard(StepHooks):
    """Hooks for one step: F versions, message headers (``headers``), the gate's check.

    Subclasses decide at the gate (:meth:`at_gate`) and call :meth:`check_kept`
    when the pre-gate work is kept.
    """

    def __init__(self, pipe: PipelineExecutor, *, headers: bool) -> None:
        self.pipe = pipe
        self.headers = headers
        self.attempt = 0
        self.gated = False  # past the gate (or replaying): every message must be current
        self.mixed: str | None = None  # a pre-gate message on another parameter version
        self.f_version: dict[tuple[int, int], int] = {}  # (stage, mb) -> version its F ran on

    def check_version(self, action: Action) -> None:
        key, version = (action.stage, action.mb), self.pipe.param_version
        if action.op is Op.F:
            self.f_version[key] = version
            return
        if self.f_version.get(key) != version:
            raise RuntimeError(
                f"rank {self.pipe.rank}: {action} runs on parameter version {version} but "
                f"its F ran on {self.f_version.get(key)}; parameters must not change "
                "between a microbatch's F and its backward"
            )
        if action.op.adds_weight_grad:
            del self.f_version[key]

    def on_replay(self) -> None:
        self.attempt += 1
        self.f_version.clear()
        self.mixed = None

    def check_kept(self) -> None:
        """At the gate without a replay: the pre-gate work must be on today's version."""
        pipe = self.pipe
        stale = sorted((k, v) for k, v in self.f_version.items() if v != pipe.param_version)
        if self.mixed or stale:
            (s, mb), v = stale[0] if stale else ((0, 0), 0)
            why = self.mixed or f"F(s{s},mb{mb}) ran on parameter version {v}"
            raise RuntimeError(
                f"rank {pipe.rank}: speculative work was kept at the gate but {why} and the "
                f"validated version is {pipe.param_version} (a replay was needed)"
            )

    def wire_meta(self, msg: Message, meta: TensorMeta) -> TensorMeta:
        return packed_meta(meta) if self.headers else meta

    def encode(self, msg: Message, t: torch.Tensor) -> torch.Tensor:
        if not self.headers:
            return t
        pipe = self.pipe
        return pack(t, Header.of(msg, pipe.iteration, pipe.param_version, self.attempt, t))

    def decode(
        self, msg: Message, buf: torch.Tensor, meta: TensorMeta, *, stale: bool
    ) -> torch.Tensor:
        """The payload; checks the header. A ``stale`` message (drained before a replay)
        must come from this attempt; its parameter version is not checked."""
        if not self.headers:
            return buf
        pipe = self.pipe
        t, head = unpack(buf, meta)
        if head.message != Header.identity(msg, meta):
            raise RuntimeError(
                f"rank {pipe.rank}: a receive of {msg} ({meta}) got a message whose header "
                f"says {head.describe()}: messages crossed (protocol bug)"
            )
        if head.iteration != pipe.iteration or head.attempt != self.attempt:
            raise RuntimeError(
                f"rank {pipe.rank}: {msg} carries iteration {head.iteration} attempt "
                f"{head.attempt} but this rank runs iteration {pipe.iteration} attempt "
                f"{self.attempt}: a stale message was not drained (protocol bug)"
            )
        if head.version != pipe.param_version and not stale:
            what = (
                f"{msg} was computed on parameter version {head.version} but rank "
                f"{pipe.rank} is on version {pipe.param_version}"
            )
            if self.gated:
                raise RuntimeError(f"one parameter version per microbatch violated: {what}")
            self.mixed = self.mixed or what
        return t
