"""benchmarks/measure.step_breakdown: a profiled step's time by category (issue 42, item 1).

Synthetic profiler events (the shape ``profile.events()`` gives), so the GPU path is checked here,
without a GPU: kernels charged to the CPU op that launched them, the device's idle time, host syncs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location("measure_bench", ROOT / "benchmarks" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Profile:
    def __init__(self) -> None:
        self.all: list[SimpleNamespace] = []

    def cpu(self, name, start, end, parent=None, kernels=(), self_us=None):
        event = SimpleNamespace(
            name=name, cpu_parent=parent, time_range=SimpleNamespace(start=start, end=end),
            kernels=[SimpleNamespace(name="k", device=0, duration=d) for d in kernels],
            self_cpu_time_total=end - start if self_us is None else self_us, device_type=DeviceType.CPU,
        )  # fmt: skip
        self.all.append(event)
        return event

    def kernel(self, start, end):
        self.all.append(
            SimpleNamespace(
                name="k",
                cpu_parent=None,
                time_range=SimpleNamespace(start=start, end=end),
                kernels=[],
                self_cpu_time_total=0,
                device_type=DeviceType.CUDA,
            )  # fmt: skip
        )

    def events(self):
        return self.all


def _gpu_step() -> Profile:
    p = Profile()  # times in microseconds
    fwd = p.cpu("census::forward", 0, 10_000)
    p.cpu("CompiledFunction", 100, 300, fwd, kernels=(5_000,))
    fsdp = p.cpu("FSDP::pre_forward", 400, 500, fwd)
    p.cpu("aten::copy_", 410, 420, fsdp, kernels=(2_000,))
    linear = p.cpu("aten::linear", 600, 700, fwd)
    p.cpu("aten::mm", 610, 690, linear, kernels=(1_500, 2_500))
    p.cpu("aten::view", 710, 720, fwd)  # no kernel: no device time
    p.cpu("aten::_local_scalar_dense", 730, 740, fwd)
    p.cpu("census::backward", 10_000, 30_000)
    node = p.cpu("autograd::engine::evaluate_function: CheckpointFunctionBackward", 10_100, 12_000)
    p.cpu("CompiledFunction", 10_200, 10_400, node, kernels=(3_000,))  # a checkpoint's recompute
    p.cpu("CompiledFunctionBackward", 12_100, 12_300, kernels=(6_000,))
    p.cpu("aten::add", 12_400, 12_410, kernels=(1_000,))  # autograd summing two gradients
    for start, end in ((200, 5_200), (5_200, 7_200), (9_000, 13_000)):  # forward: 13 ms, 4 busy
        p.kernel(start, end)
    for start, end in ((10_500, 13_500), (14_000, 20_000), (20_000, 21_000)):
        p.kernel(start, end)
    return p


def test_device_time_goes_to_the_graph_the_recompute_fsdp_or_the_eager_op_that_launched_it(measure) -> None:
    out = measure.step_breakdown(_gpu_step())
    assert out["time_kind"] == "device kernels"
    fwd, bwd = out["forward"], out["backward"]
    assert fwd["ms"] == {
        "graphs": 5.0, "recompute": 0.0, "backward graphs": 0.0, "fsdp": 2.0, "eager": 4.0,
        "idle": pytest.approx(1.8),  # 12.8 ms from the first kernel to the last, 11 busy
    }  # fmt: skip
    assert fwd["eager_ms_by_op"] == {"aten::linear": 4.0}  # the outermost op, not the mm inside
    assert fwd["kernels"] == {
        "graphs": 1,
        "recompute": 0,
        "backward graphs": 0,
        "fsdp": 1,
        "eager": 2,
        "idle": 0,
    }
    assert fwd["host_syncs"] == 1
    assert bwd["ms"]["recompute"] == 3.0 and bwd["ms"]["graphs"] == 0.0
    assert bwd["ms"]["backward graphs"] == 6.0 and bwd["ms"]["eager"] == 1.0
    assert bwd["ms"]["idle"] == pytest.approx(0.5)
    assert bwd["eager_ms_by_op"] == {"aten::add": 1.0} and bwd["host_syncs"] == 0


def test_without_kernels_the_cpu_proxy_charges_each_event_its_self_time(measure) -> None:
    p = Profile()
    fwd = p.cpu("census::forward", 0, 1_000)
    p.cpu("CompiledFunction", 10, 110, fwd, self_us=100)
    p.cpu("aten::view", 200, 210, fwd, self_us=10)
    p.cpu("autograd::engine::evaluate_function: X", 300, 350, fwd, self_us=50)
    p.cpu("census::backward", 1_000, 2_000)
    out = measure.step_breakdown(p)
    assert out["time_kind"] == "cpu self time"
    assert out["forward"]["ms"]["graphs"] == 0.1 and out["forward"]["ms"]["idle"] is None
    assert out["forward"]["eager_ms_by_op"] == {"host": 0.05, "aten::view": 0.01}
    assert out["forward"]["kernels"] is None


def test_a_graph_without_a_backward_is_a_graph_and_aot_glue_around_one_with_is_eager(measure) -> None:
    # graphs_in_range marks every call of a compiled graph; AOTAutograd's CompiledFunction marks
    # only those with a backward, and replays an output's view outside it.
    p = Profile()
    fwd = p.cpu("census::forward", 0, 1_000)
    training = p.cpu(measure.GRAPH_CALL, 10, 100, fwd)
    p.cpu("CompiledFunction", 20, 80, training, kernels=(40,))
    p.cpu("aten::view", 85, 90, training)  # the replayed alias: eager glue
    inference = p.cpu(measure.GRAPH_CALL, 110, 200, fwd)  # routing only: no backward
    p.cpu("aten::argsort", 120, 190, inference, kernels=(60,))
    bwd = p.cpu("census::backward", 1_000, 2_000)
    graph = p.cpu("CompiledFunctionBackward", 1_100, 1_500, bwd, kernels=(100,))
    recompute = p.cpu(measure.GRAPH_CALL, 1_200, 1_300, graph)  # its unpacking started a recompute
    p.cpu("CompiledFunction", 1_210, 1_290, recompute, kernels=(30,))
    census = measure.step_census(p)
    assert census["forward"]["forward_graphs"] == 2  # one per call, not one per range
    assert census["forward"]["eager_by_op"] == {"aten::view": 1}
    assert census["backward"]["forward_graphs"] == 1 and census["backward"]["backward_graphs"] == 1
    ms = measure.step_breakdown(p)
    assert ms["forward"]["ms"]["graphs"] == pytest.approx(0.1) and ms["forward"]["ms"]["eager"] == 0.0
    assert ms["backward"]["ms"]["recompute"] == pytest.approx(0.03)
    assert ms["backward"]["ms"]["backward graphs"] == pytest.approx(0.1)


def test_an_eager_checkpoints_recompute_is_its_own_not_the_backward_graphs(measure) -> None:
    # Synthetic: a backward graph unpacks what it saved, which runs the recompute inside its range.
    p = Profile()
    p.cpu("census::forward", 0, 1_000)
    bwd = p.cpu("census::backward", 1_000, 2_000)
    graph = p.cpu("CompiledFunctionBackward", 1_100, 1_900, bwd, kernels=(100,))
    recompute = p.cpu(measure.RECOMPUTE, 1_200, 1_800, graph)
    p.cpu("aten::view", 1_210, 1_220, recompute)
    p.cpu("CompiledFunction", 1_300, 1_400, recompute, kernels=(50,))
    p.cpu("aten::mul", 1_500, 1_600, recompute, kernels=(20,))
    census = measure.step_census(p)["backward"]
    assert census["eager_by_op"] == {"aten::view": 1, "aten::mul": 1} and census["recompute_eager_ops"] == 2
    assert census["forward_graphs"] == 1 and census["backward_graphs"] == 1
    ms = measure.step_breakdown(p)["backward"]["ms"]
    assert ms["recompute"] == pytest.approx(0.07) and ms["backward graphs"] == pytest.approx(0.1)


def test_profiled_step_marks_torchs_checkpoint_recompute_and_puts_torch_back(measure) -> None:
    import torch
    import torch.utils.checkpoint as checkpoint

    if not hasattr(checkpoint, "_CheckpointFrame"):
        pytest.skip("this torch keeps no _CheckpointFrame: the census marks no recompute")
    before = checkpoint._CheckpointFrame.__init__
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    prof = measure.profiled_step(
        lambda: checkpoint.checkpoint(lambda t: layer(t).relu(), x, use_reentrant=False),
        lambda out: out.sum().backward(),
    )
    census = measure.step_census(prof)
    assert census["forward"]["recompute_eager_ops"] == 0
    assert census["backward"]["recompute_eager_ops"] >= 2, census  # linear and relu, again
    assert checkpoint._CheckpointFrame.__init__ is before
