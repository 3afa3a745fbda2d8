"""One checkpoint key scheme: the user's model's names.

A :class:`~zerobubble.Pipeline`'s checkpoint keys every parameter, buffer and optimizer
entry by the model's state-dict keys (``model.<key>``, ``buffer.<key>``,
``optim.<key>.<field>``), whatever the stage cut; a tie is one entry under its first name.
Over 3 gloo ranks, our GPT with tied embeddings under zb-h1 (the tie across ranks 0 and 2)
and under zbv (a V placement: rank 0 holds stages 0 and 5, both replicas of the tie, which
share memory): train 2 AdamW steps, save, train 2 more; fresh processes load and train the
same 2: losses, parameters and AdamW state are bitwise those of the first run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint

P, M, SAVE_AT, STEPS = 3, 6, 2, 4
CFG = GPTConfig(vocab_size=11, max_seq_len=5, d_model=8, n_heads=2, n_layers=4, tie_embeddings=True)


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + k)
    return torch.randint(0, 11, (M, 5), generator=gen), torch.randint(0, 11, (M, 5), generator=gen)


def blob(t: torch.Tensor) -> bytes:
    return t.detach().numpy().tobytes()


def job(root: str, kind: str, resume: bool) -> dict:
    zerobubble.init_distributed()
    torch.manual_seed(0)
    pipe = zerobubble.Pipeline(build_gpt(CFG), gpt_loss, kind, microbatches=M)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    trainer = pipe.set_optimizer(opt, zerobubble.OptimConfig(max_norm=1.0))
    if resume:
        load_checkpoint(trainer, root)
    losses = []
    for k in range(SAVE_AT if resume else 0, STEPS):
        x, y = batch(k)
        out = pipe.step(x, target=y)
        losses.append(None if out is None else [float(v) for v in out])
        if not resume and k + 1 == SAVE_AT:
            save_checkpoint(trainer, root)
    pipe.drain()
    return {
        "losses": losses,
        "state": {
            n: (blob(p), {f: blob(v) for f, v in opt.state[p].items()})
            for n, p in pipe.named_parameters()
        },
    }


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_checkpoints_are_keyed_by_the_models_names_and_resume_bitwise(tmp_path: Path, kind):
    first = launch(job, P, str(tmp_path), kind, False, timeout=300)
    stored = FileSystemReader(str(tmp_path / f"step_{SAVE_AT:08d}")).read_metadata()
    keys = set(stored.state_dict_metadata)
    model = build_gpt(CFG)
    names = [n for n, _ in model.named_parameters()]  # a tie once, under its first name
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(names)
    want = {f"optim.{n}.{f}" for n in names for f in ("step", "exp_avg", "exp_avg_sq")}
    assert {k for k in keys if k.startswith("optim.")} == want
    second = launch(job, P, str(tmp_path), kind, True, timeout=300)
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a["losses"][SAVE_AT:] == b["losses"], rank
        assert a["state"] == b["state"], rank
