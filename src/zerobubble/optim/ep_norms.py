"""The gradient norm under expert parallelism: every expert counted once, in model order.

An ep rank holds only its experts, so its pipeline's norm vector would miss the
other ep ranks' experts. The layout instead has a slot for every expert parameter of
the whole model (:func:`expert_slots`: a run of local expert parameters stands for
``ep`` runs, ep rank 0's first, which is the order of the unsharded model's
parameters); a rank fills its own slots, and the ep ranks sum these vectors
(:meth:`ExpertNorms.merge`) before the pipeline's all-reduce, or under post-validation
before the rank adds them to the prefix state it passes on (every ep peer then
receives, holds and decides on the same state). That sum is exact: each slot is
filled by one rank only (dense slots by ep rank 0; the others zero theirs), so every
addition adds zeros. Expert gradients were already summed over ``edp`` by the
reduction and are the same on every replica, so nothing is counted twice; the global
norm is then :func:`torch.nn.utils.clip_grad_norm_`'s over the unsharded model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from zerobubble.optim.norms import ParamLayout, Remote
from zerobubble.parallel.ep import expert_run
from zerobubble.runtime.p2p.comm import P2P

__all__ = ["ExpertNorms", "expert_slots"]


def expert_slots(
    stage_params: Mapping[int, Sequence[Tensor]], ep_rank: int, ep_size: int
) -> dict[int, list[Tensor | Remote]]:
    """Each stage's parameters with every run of local expert parameters widened to all
    ``ep_size`` ranks' runs (the other ranks' as :class:`~zerobubble.optim.norms.Remote`)."""
    out: dict[int, list[Tensor | Remote]] = {}
    for s, params in stage_params.items():
        slots: list[Tensor | Remote] = []
        i = 0
        while i < len(params):
            run = expert_run(params[i])
            if run is None:
                slots.append(params[i])
                i += 1
                continue
            j = i
            while j < len(params) and expert_run(params[j]) == run:
                j += 1
            mine = list(params[i:j])
            for q in range(ep_size):
                slots += mine if q == ep_rank else [Remote(p.dtype) for p in mine]
            i = j
        out[s] = slots
    return out


class ExpertNorms:
    """Completes a rank's norm vector with its ep peers' expert slots (collective over ep).

    Args:
        layout: The pipeline's :class:`~zerobubble.optim.norms.ParamLayout` over
            :func:`expert_slots`.
        slots: ``stage -> slots`` from :func:`expert_slots`.
        ep_rank: This rank's place in ``group``.
        group: The mesh's ``ep_group``.
        p2p: Bounds the wait (the pipeline's comm timeout).
    """

    def __init__(
        self,
        layout: ParamLayout,
        slots: Mapping[int, Sequence[Tensor | Remote]],
        ep_rank: int,
        group: dist.ProcessGroup,
        p2p: P2P,
    ) -> None:
        dense = [
            layout.first[s] + i
            for s, ps in slots.items()
            for i, p in enumerate(ps)
            if not isinstance(p, Remote) and expert_run(p) is None
        ]
        index = torch.tensor(dense, dtype=torch.long)
        self._zero = torch.cat([index, index + layout.size]) if ep_rank else None
        self.group, self.p2p = group, p2p

    def merge(self, vec: Tensor, iteration: int) -> None:
        """Sum ``vec`` (filled by this rank) over the ep ranks, dense slots from ep rank 0."""
        if self._zero is not None:
            vec[self._zero] = 0.0
        what = f"all-reduce over dim 'ep' of iteration {iteration}'s expert gradient norms"
        work = dist.all_reduce(vec, group=self.group, async_op=True)
        assert work is not None
        self.p2p.wait_collective(work, what, self.group)
