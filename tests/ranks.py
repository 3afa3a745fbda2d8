"""``launch`` for the tests: ranks forked from a server that imported torch once.

A spawned rank imports torch itself, seconds of CPU each on a loaded machine, and the
suite starts a few hundred ranks; the server imports torch, the library and the Hugging Face
adapter once, and every rank forks from it. The launcher's own tests (test_launcher.py) cover
both start methods.
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

from zerobubble.runtime.launcher import launch as _launch

PRELOAD = [
    "torch",
    "torch.distributed",
    "zerobubble.executor",
    "zerobubble.optim.trainer",
    "zerobubble.reference.compose",
    "zerobubble.models",
    # The Hugging Face adapter and the model families the suite builds most: about 1.6 s of
    # imports per rank otherwise (an import that fails, transformers missing, is skipped).
    "zerobubble.interop.hf",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2",
]


def launch(fn: Any, nprocs: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`zerobubble.runtime.launcher.launch` with ``start_method="forkserver"``.

    ``fn`` and ``args`` travel as one plain pickle: multiprocessing's own pickler would
    hand every tensor over as a file descriptor, and a forkserver start takes at most
    about 250 of them.
    """
    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs
    blob = pickle.dumps((fn, args))
    return _launch(_call, nprocs, blob, start_method="forkserver", **kwargs)


def _call(blob: bytes) -> Any:
    fn, args = pickle.loads(blob)
    return fn(*args)
