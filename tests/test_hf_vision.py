"""Hugging Face vision models as pipelines: split coverage outside language models.

ConvNext keeps its activations channels_last (its blocks permute to (N, H, W, C) and back),
and its depthwise conv takes another kernel path on a row-major input: a boundary must keep
the producer's memory format, on the activation and on the gradient sent back, or the
gradients differ in the last bits (zb-h1 at P=2: all 48, by up to 2.4e-7).
MobileNetV2's TF-style padding reads its convs' ``stride`` and ``kernel_size``, which the
B/W split's layers must answer for the conv they replace (they raised AttributeError).

Bitwise means ``torch.equal`` against :func:`~zerobubble.reference.step.reference_step`, the
single-process reference on the same microbatches with the same seed (MobileNetV2's
classifier dropout draws alike): every loss, every gradient, and every buffer (BatchNorm's
running statistics and counts). The models are built from tiny configs, nothing downloaded;
they are cut by hand (below) into the layers a ``Pipeline`` takes.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

import zerobubble  # noqa: E402
from ranks import launch  # noqa: E402
from zerobubble.reference.step import reference_step  # noqa: E402
from zerobubble.runtime.launcher import LaunchError  # noqa: E402
from zerobubble.runtime.split import SplitOp, WeightGradStore, enable_bw_split  # noqa: E402

pytestmark = pytest.mark.bitwise

TIMEOUT = 300.0
M = 4
COMM_S = 300.0  # the failing test's comm timeout: its peers must not wait for it


class ConvNextHead(nn.Module):
    """ConvNextModel's pooling and final norm, then the classifier, as its forward has them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.layernorm = model.convnext.layernorm
        self.classifier = model.classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.layernorm(x.mean([-2, -1])))


def convnext_layers() -> list[nn.Module]:
    """Tiny ConvNext as ``[embeddings, blocks and downsampling in order, head]`` (7 layers)."""
    cfg = transformers.ConvNextConfig(
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[2, 2]
    )
    cfg.num_labels = 3
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(cfg)
    layers: list[nn.Module] = [model.convnext.embeddings]
    for stage in model.convnext.encoder.stages:
        if len(stage.downsampling_layer):
            layers.append(nn.Sequential(*stage.downsampling_layer))
        layers.extend(stage.layers)
    return [*layers, ConvNextHead(model)]


class MobileNetHead(nn.Module):
    """MobileNetV2's last 1x1 conv, pooling, (in-place) dropout and classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.conv_1x1 = model.mobilenet_v2.conv_1x1
        self.pooler = model.mobilenet_v2.pooler
        self.dropout = model.dropout
        self.classifier = model.classifier

    def forward(self, x: Tensor) -> Tensor:
        pooled = torch.flatten(self.pooler(self.conv_1x1(x)), start_dim=1)
        return self.classifier(self.dropout(pooled))


def mobilenet_model() -> nn.Module:
    """Tiny MobileNetV2 with the default ``tf_padding`` and its classifier dropout."""
    cfg = transformers.MobileNetV2Config(
        num_channels=3, image_size=16, depth_multiplier=0.25, finegrained_output=False
    )
    cfg.num_labels = 3
    torch.manual_seed(0)
    return transformers.MobileNetV2ForImageClassification(cfg)


def mobilenet_layers() -> list[nn.Module]:
    """``[stem, 16 inverted residual blocks, head]``."""
    model = mobilenet_model()
    return [model.mobilenet_v2.conv_stem, *model.mobilenet_v2.layer, MobileNetHead(model)]


MODELS = {"convnext": convnext_layers, "mobilenet_v2": mobilenet_layers}


def step_against_reference(
    name: str, kind: str, group: dist.ProcessGroup | None = None
) -> list[str]:
    """One step of ``name`` pipelined with ``kind``; what differs from reference_step."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 16, 16, generator=gen)
    target = torch.randint(0, 3, (8,), generator=gen)
    options = zerobubble.ExecutorOptions(trace=False, comm_timeout_s=60)
    pipe = zerobubble.Pipeline(
        MODELS[name](), F.cross_entropy, kind, microbatches=M, group=group, options=options
    )
    losses = pipe.step(x, target=target)
    ref = MODELS[name]()
    stages = pipe.executor.schedule.num_stages
    want, grads = reference_step(ref, F.cross_entropy, x, target, M, num_stages=stages, seed=0)
    state = nn.Sequential(*ref).state_dict()
    # this rank's entries: parameters (not stepped) and buffers (running statistics, counts)
    bad = [
        f"{name}: state {k}" for k, v in pipe.state_dict().items() if not torch.equal(v, state[k])
    ]
    for k, p in pipe.named_parameters():
        if p.grad is None or not torch.equal(p.grad, grads[k]):
            bad.append(f"{name}: grad {k}")
    if losses is not None and not all(map(torch.equal, losses, want)):
        bad.append(f"{name}: losses")
    return bad


def bitwise_job() -> list[str]:
    """P=3 (zb-h1) over the three ranks, then P=2 (zbv: two stages per rank, a local
    boundary) over ranks 0 and 1: one launch, as the ranks' imports cost seconds each."""
    zerobubble.init_distributed(timeout_s=60)
    pair = dist.new_group([0, 1])
    bad = [f"P=3: {b}" for name in MODELS for b in step_against_reference(name, "zb-h1")]
    if dist.get_rank() < 2:
        bad += [f"P=2: {b}" for name in MODELS for b in step_against_reference(name, "zbv", pair)]
    dist.destroy_process_group()
    return bad


@pytest.mark.slow
def test_convnext_and_mobilenet_v2_pipelined_at_p2_and_p3_are_bitwise_reference_step():
    """ConvNext (channels_last activations and gradients across every boundary) and
    MobileNetV2 (TF padding reading split convs' attributes; BatchNorm buffers; dropout):
    losses, every gradient and every buffer torch.equal to reference_step's."""
    results = launch(bitwise_job, 3, timeout=TIMEOUT)
    assert [b for rank in results for b in rank] == []


def test_split_layers_answer_for_the_layer_they_replace():
    """MobileNetV2's forward reads ``conv.stride`` and ``conv.kernel_size`` (TF padding): with
    its convs split it runs, equal to the unsplit model; the split layers expose the
    wrapped layer's attributes, and one it lacks raises an AttributeError naming both."""
    model = mobilenet_model().eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    want = model(x).logits
    split = enable_bw_split(model, WeightGradStore())
    conv = split.mobilenet_v2.conv_stem.first_conv.convolution
    assert isinstance(conv, SplitOp)
    assert (conv.stride, conv.kernel_size, conv.in_channels, conv.groups) == ((2, 2), (3, 3), 3, 1)
    assert conv.padding_mode == "zeros" and conv.weight is conv.layer.weight
    head = split.classifier
    assert (head.in_features, head.out_features) == (320, 3)
    assert torch.equal(split(x).logits, want)
    with pytest.raises(
        AttributeError, match=r"'SplitOp' object \(the split Conv2d\) has no .*'tf'"
    ):
        _ = conv.tf
    # a write of the layer's configuration reaches the op that reads it
    plain = torch.nn.Conv2d(3, 4, 3)
    twin = enable_bw_split(torch.nn.Sequential(copy.deepcopy(plain)), WeightGradStore())[0]
    twin.padding = plain.padding = (2, 2)
    assert twin.layer.padding == (2, 2) and "padding" not in twin.__dict__
    image = torch.randn(1, 3, 5, 5, generator=torch.Generator().manual_seed(4))
    assert torch.equal(twin(image), plain(image)) and plain(image).shape[-1] == 7


def test_boundary_frames_keep_the_producers_memory_format():
    """A channels_last activation, a transposed matrix and a size-1 channel come out of a
    frame with the strides they went in with; a tensor with gaps arrives row-major."""
    from zerobubble.runtime.p2p.wire import FRAME_HEADER, pack_frame, unpack_frame
    from zerobubble.runtime.shapes import Layout, describe, flatten, kept_strides, unflatten

    g = torch.Generator().manual_seed(0)
    nhwc = torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)
    one_channel = torch.randn(2, 1, 4, 4, generator=g).to(memory_format=torch.channels_last)
    tree = {
        "x": nhwc.requires_grad_(True),
        "t": torch.randn(3, 6, generator=g).t(),
        "c1": one_channel,
        "gap": torch.randn(4, 6, generator=g)[:, ::2],
        "row": torch.arange(6),
    }
    codes, tensors = flatten(tree, "stage 0 output")
    assert kept_strides(tree["gap"]) is None and kept_strides(tree["row"]) is None
    assert "[2, 3, 4, 5] float32 strides (60, 1, 15, 3) (grad)" in describe(codes)
    layout = Layout.of(codes, FRAME_HEADER)
    got = unflatten(codes, unpack_frame(pack_frame(layout, tensors, torch.device("cpu")), layout))
    for key in ("x", "t", "c1"):
        assert got[key].stride() == tree[key].stride() and torch.equal(got[key], tree[key]), key
    assert got["x"].is_contiguous(memory_format=torch.channels_last) and got["x"].requires_grad
    assert got["gap"].is_contiguous() and torch.equal(got["gap"], tree["gap"])


class ReadsConfig(nn.Module):
    """A layer whose forward reads an attribute its conv does not have (as MobileNetV2's
    padding read ``stride`` of a split conv before the split layers answered for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x) * self.conv.tf_scale


def failing_layers(stage: int) -> list[nn.Module]:
    """``[conv, conv, conv, flatten]`` with layer ``stage`` reading a missing attribute."""
    layers: list[nn.Module] = [nn.Conv2d(2, 2, 3, padding=1) for _ in range(3)]
    layers[stage] = nn.Sequential(nn.Tanh(), ReadsConfig())
    return [*layers, nn.Flatten()]


def failing_job() -> None:
    zerobubble.init_distributed(timeout_s=COMM_S)
    options = zerobubble.ExecutorOptions(trace=False, comm_timeout_s=COMM_S)
    pipe = zerobubble.Pipeline(
        failing_layers(1),
        F.mse_loss,
        "zb-h1",
        microbatches=2,
        boundaries=[0, 1, 2, 4],
        options=options,
    )
    pipe.step(torch.randn(4, 2, 3, 3), target=torch.randn(4, 18))


@pytest.mark.slow
def test_an_error_in_a_later_stage_names_it_and_the_layer_and_its_peers_fail_at_once():
    """Stage 1 of 3 reads an attribute its (split) conv lacks: its rank names the stage,
    the microbatch and the layer (module path in the stage) whose code raised, as the
    stage's own failure, not a boundary mismatch with stage 0 (which it was). Both
    neighbours fail on their own on the closed connection ("the transport failed", not the
    timeout's message), long before the comm timeout (300 s)."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(failing_job, 3, timeout=2 * COMM_S, grace=COMM_S - 30)
    assert time.monotonic() - start < COMM_S / 2
    by_rank = {f.rank: f.error for f in err.value.failures}
    want = (
        "StageChunkError: stage 1, microbatch 0: forward (rank 1) failed in layer '0.1' "
        "(ReadsConfig): AttributeError: 'SplitOp' object (the split Conv2d) has no attribute "
        "'tf_scale'"
    )
    assert want in by_rank[1] and "ShapeMismatchError" not in by_rank[1], by_rank[1]
    for rank in (0, 2):
        assert "PeerError" in by_rank[rank] and "the transport failed" in by_rank[rank]


def test_an_error_in_stage_0_keeps_its_type_with_a_note_naming_stage_and_layer(tmp_path):
    """One rank, two stages (zbv): the user's own exception type, and a note (shown with
    its traceback) naming the stage, the microbatch, the rank and the layer."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        options = zerobubble.ExecutorOptions(trace=False)
        pipe = zerobubble.Pipeline(
            failing_layers(0),
            F.mse_loss,
            "zbv",
            microbatches=2,
            boundaries=[0, 2, 4],
            options=options,
        )
        with pytest.raises(AttributeError, match="no attribute 'tf_scale'") as err:
            pipe.step(torch.randn(4, 2, 3, 3), target=torch.randn(4, 18))
    finally:
        dist.destroy_process_group()
    note = "stage 0, microbatch 0: forward (rank 0) failed in layer '0.1' (ReadsConfig)"
    assert err.value.__notes__ == [note]


def test_seed_none_is_refused_naming_the_option_and_the_fix():
    with pytest.raises(ValueError, match=r"ExecutorOptions\(seed=None\): seed must be an int"):
        zerobubble.ExecutorOptions(seed=None)  # type: ignore[arg-type]
    assert zerobubble.ExecutorOptions(seed=torch.tensor(7).numpy()[()]).seed == 7
