"""The plan log and the report: folding, counting against a counting backend, fallback detection."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat, _instances, _log, _state
from autoweave._settings import Settings
from autoweave.observe import report, report_exit, summary
from autoweave.sense import names
from benchmarks.measure import forward_gemms_outside_graphs
from tests.distributed import run_ranks
from tests.models import Block, Experts, RecompileLimitHits, make_break, recompiles, train_chain

ROOT = Path(__file__).resolve().parents[1]


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(moe=False)] + [Block() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def weave_on(weave_on):  # the shared one (tests/conftest.py), and the report stopped first
    yield
    report.stop()


def test_fold_names() -> None:
    assert summary.fold_names(["layers.1", "layers.2", "layers.3"]) == "layers.1-3"
    assert summary.fold_names(["layers.1.moe.experts", "layers.2.moe.experts"]) == "layers.1-2.moe.experts"
    assert summary.fold_names(["layers.1", "layers.3"]) == "layers.{1,3}"
    assert summary.fold_names(["a", "b"]) == "a, b"


def test_display_path_drops_wrapper_segments() -> None:
    assert names.display_path("_checkpoint_wrapped_module.moe.experts") == "moe.experts"
    assert names.display_path("_orig_mod._checkpoint_wrapped_module") == "<root>"


def test_settings_report_variable() -> None:
    assert Settings.from_environ({"AUTOWEAVE_REPORT": " /tmp/r{rank}.json "}).report == "/tmp/r{rank}.json"
    assert Settings.from_environ({"AUTOWEAVE_REPORT": ""}).report is None
    bad = Settings.from_environ({"AUTOWEAVE_REPORT": "/tmp/r{node}.json"})
    assert bad.report is None and bad.problems[0].startswith("AUTOWEAVE_REPORT=")


def test_every_action_has_a_verb_in_the_plan_log() -> None:
    from autoweave.planning.plans import Action

    assert set(summary._VERBS) == set(Action)


def test_plan_log_folds_blocks_and_names_them(weave_on, caplog) -> None:
    torch.manual_seed(0)
    model = Stack()
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    x = torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="autoweave"):
        model(x).sum().backward()
        assert not [r for r in caplog.records if r.getMessage().startswith("autoweave plan")]
        model(x).sum().backward()  # the next step: every block has planned
    summaries = [r for r in caplog.records if r.getMessage().startswith("autoweave plan")]
    assert len(summaries) == 1 and summaries[0].levelno == 25
    text = summaries[0].getMessage()
    assert text.splitlines()[0] == "autoweave plan: 4 compiled modules, 3 woven"
    assert "  layers.0 (Block): no boundary inside" in text
    assert (
        "layers.1.ffn.experts [Experts] boundary: a hook is torch.compiler.disable'd → hooks stay eager"
        in text
    )
    assert "  layers.2-3 (2 × Block): same plan as layers.1" in text


class _ReferenceBackend:
    """The test's own count of what dynamo hands a backend (not ``sense.counting``'s).

    Every graph, and its ops: the ``call_function`` nodes of the graph and of the
    sub-graphs its higher-order ops call (a traced checkpoint's body).
    """

    def __init__(self) -> None:
        self.ops_per_graph: list[int] = []

    @staticmethod
    def _ops(graph_module: torch.fx.GraphModule) -> int:
        ops = 0
        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                ops += 1
            elif node.op == "get_attr":
                target = getattr(graph_module, node.target, None)
                if isinstance(target, torch.fx.GraphModule):
                    ops += _ReferenceBackend._ops(target)
        return ops

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.ops_per_graph.append(self._ops(gm))
        return gm.forward  # run what dynamo traced, as it is


def test_report_counts_match_a_counting_backend(weave_on, tmp_path) -> None:
    torch.manual_seed(0)
    counters.clear()
    report.start(str(tmp_path / "r{rank}.json"))
    model, reference = Stack(), _ReferenceBackend()
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(cw.checkpoint_wrapper(block), backend=reference)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    outside = forward_gemms_outside_graphs(model, torch.randn(4, 8))
    data = report.stop()
    # The report's counts against the graphs the backend itself was handed, and dynamo's own count.
    graphs, ops = len(reference.ops_per_graph), sum(reference.ops_per_graph)
    assert graphs == int(counters["stats"]["unique_graphs"]) > 0
    assert (data["totals"]["graphs"], data["totals"]["ops"]) == (graphs, ops)
    assert sum(r["graphs"] for r in data["regions"]) == graphs
    assert sum(r["ops"] for r in data["regions"]) == ops
    assert data["totals"] == {**data["totals"], "modules": 4, "woven": 3}
    assert data["ac_fallbacks"]["count"] == 0
    regions = {r["label"]: r for r in data["regions"]}
    shared = [r for r in regions.values() if r["modules"] == ["layers.1", "layers.2", "layers.3"]]
    assert len(shared) == 1 and shared[0]["kind"] == "woven"
    assert [r["modules"] for r in regions.values() if r["kind"] == "plain"] == [["layers.0"]]
    plan = data["plans"][1]
    assert plan["name"] == "layers.1" and plan["woven"]
    assert {d["path"] for d in plan["decisions"]} == {"layers.1", "layers.1.ffn.experts"}
    # This backend runs what dynamo traced as it is (no AOTAutograd graph): by autograd's record of
    # step 2, as by the profiler's, every GEMM ran outside a compiled graph.
    assert data["measured"]["modules"] == 4, data["measured"]
    assert data["measured"]["eager_gemms"] == outside > 0, (data["measured"], outside)
    summary = report_exit.format_exit_summary(data, "r0.json")
    assert f"{graphs} graphs, {ops} ops captured" in summary
    assert "checkpointed regions that fell back to eager: 0" in summary
    assert len(summary.splitlines()) <= 20


def test_fallback_detected_for_compiles_autoweave_did_not_route(weave_on) -> None:
    report.start(None)
    with autoweave.disabled():
        model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    model(torch.randn(4, 8)).sum().backward()
    data = report.stop()
    assert data["ac_fallbacks"]["count"] >= 1
    assert "fall back to eager-mode PyTorch" in data["ac_fallbacks"]["messages"][0]["message"]
    assert "WARNING" in report_exit.format_exit_summary(data, None)


def test_a_plain_compile_is_not_counted_without_a_report() -> None:
    model = nn.Linear(2, 2)
    report.count_plain(model, torch.compile(model, backend="eager"))
    assert model not in _state.run.plain_labels


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "module.compile"])
def test_the_report_leaves_a_plain_compiles_backend_as_torch_built_it(weave_on, in_place: bool) -> None:
    # A counting wrapper around the backend hid the inductor wrapper's public config (None).
    mode = "max-autotune-no-cudagraphs"
    expected = torch._TorchCompileInductorWrapper(mode, None, None).get_compiler_config()
    report.start(None)
    model = nn.Linear(4, 4)
    if in_place:
        model.compile(mode=mode)
        compiled = _instances.dispatcher_of(model)._plain  # what nn.Module.compile made
    else:
        compiled = torch.compile(model, mode=mode)
    assert compiled.get_compiler_config() == expected
    assert type(_compat.backends.compile_wrapper_of(compiled)) is torch._TorchCompileInductorWrapper
    # And the graphs dynamo hands a plain compile's own backend are counted under its region.
    model = Small()
    if in_place:
        model.compile(backend="aot_eager")
    else:
        model = torch.compile(model, backend="aot_eager")
    model(torch.randn(2, 8))
    plain = [r for r in report.stop()["regions"] if r["kind"] == "plain" and r["graphs"]]
    assert [(r["graphs"], r["ops"]) for r in plain] == [(1, 4)]


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _ten_compiled_blocks(*, reporting: bool, fullgraph: bool, in_place: bool) -> dict:
    """Ten identical blocks, each compiled on its own (torchtitan's per-layer ``block.compile()``)."""
    torch._dynamo.reset()
    counters.clear()
    _state.reset()
    if reporting:
        report.start(None)
    torch.manual_seed(0)
    blocks = [Small() for _ in range(10)]
    for i, block in enumerate(blocks):
        if in_place:
            block.compile(backend="aot_eager", fullgraph=fullgraph)
        else:
            blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=fullgraph)
    model = nn.Sequential(*blocks)
    x = torch.randn(4, 8)
    with RecompileLimitHits() as hits, recompiles() as again:
        for _ in range(3):
            model(x).sum().backward()
        eager_gemms = forward_gemms_outside_graphs(model, x)
        out = model(x)
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": len(again),
        "limit_hits": hits.messages,
        "eager_gemms": eager_gemms,
        "out": out.detach(),
        "report": report.stop(),
    }


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "module.compile"])
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks-allowed", "fullgraph"])
def test_the_report_changes_nothing_that_compiles(weave_on, fullgraph: bool, in_place: bool) -> None:
    # One counting backend per compile used to defeat dynamo's backend match:
    # 8 graphs, the recompile limit, blocks 9-10 eager (fullgraph: raised).
    plain = _ten_compiled_blocks(reporting=False, fullgraph=fullgraph, in_place=in_place)
    observed = _ten_compiled_blocks(reporting=True, fullgraph=fullgraph, in_place=in_place)
    assert plain["report"] is None and plain["limit_hits"] == [] and plain["eager_gemms"] == 0
    same = ("graphs", "recompiles", "limit_hits", "eager_gemms")
    assert [observed[k] for k in same] == [plain[k] for k in same]
    torch.testing.assert_close(observed["out"], plain["out"], rtol=0, atol=0)
    data = observed["report"]
    # The report's own numbers: what compiled, counted once, in the regions that compiled it.
    assert data["dynamo"]["unique_graphs"] == plain["graphs"]
    assert data["dynamo"]["recompile_limit_hits"] == []
    assert data["totals"]["graphs"] == sum(r["graphs"] for r in data["regions"]) == plain["graphs"]
    # Recompiles: only the model's own (the blocks after the first see an input that requires grad).
    assert data["dynamo"]["recompiles"] == plain["recompiles"] == 1
    assert sum(r["recompiles"] for r in data["regions"]) == 1
    assert len(data["regions"]) == 10 and data["totals"]["modules"] == 10


def _backend_chains(*, reporting: bool) -> dict:
    """Compile a selective-AC block woven as pieces; the backends dynamo called for its regions' graphs.

    Each chain lists the frames between dynamo and the user's backend (outermost
    first), read off the stack while the user's backend runs.
    """

    from autoweave import _compat
    from tests import break_models as bm

    torch._dynamo.reset()
    _state.reset()
    if reporting:
        report.start(None)
    aot_eager = _compat.backends.lookup_backend("aot_eager")
    dynamo_dir = os.path.dirname(torch._dynamo.__file__)
    chains: list[tuple[str, ...]] = []

    def users_backend(gm, example_inputs):
        code = _compat.dynamo.code_being_compiled()
        if code is not None and code.co_name.startswith("autoweave_"):  # a woven region's graph
            chain, frame = [], sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(dynamo_dir):
                chain.append(frame.f_code.co_qualname)
                frame = frame.f_back
            chains.append(tuple(reversed(chain)))
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    block = bm.with_ac(bm.GlueGemmBlock(16), "selective")
    model = torch.compile(autoweave.set_mode(block, strategy="pieces"), backend=users_backend)
    x = torch.randn(12, 16)
    for _ in range(2):
        model(x).sum().backward()
    assert autoweave.plan(block).decision("_checkpoint_wrapped_module").pieces
    return {"chains": chains, "report": report.stop(), "out": model(x).detach()}


def test_a_woven_region_compiles_through_the_same_backend_with_the_report_on_or_off(weave_on) -> None:
    off = _backend_chains(reporting=False)
    on = _backend_chains(reporting=True)
    assert off["chains"], "no woven region's graph reached the backend"
    assert on["chains"] == off["chains"]  # observing hands dynamo the very same backend
    torch.testing.assert_close(on["out"], off["out"], rtol=0, atol=0)
    # torch's own wrapper around the region's backend, and torch's around the user's: nothing more.
    assert [name for name in off["chains"][0] if name.endswith("__call__")] == [
        "_TorchCompileWrapper.__call__",
        "RegionBackend.__call__",
        "_TorchCompileWrapper.__call__",
    ]
    # And the report still counted the region's graphs, through the backend's observer.
    woven = [r for r in on["report"]["regions"] if r["kind"] == "woven"]
    assert sum(r["graphs"] for r in woven) >= len(on["chains"]) and on["report"]["totals"]["ops"] > 0


def _run_job(tmp: Path, weave: str, template: str, *, spawn: bool = False) -> tuple[Path, str]:
    """The example under gloo FSDP2 on 2 ranks, ``AUTOWEAVE=1`` in every process's environment.

    With torchrun the launcher process inherits AUTOWEAVE=1 and AUTOWEAVE_REPORT and
    imports torch, but compiles nothing; with ``spawn`` no process has RANK set.
    """
    out = tmp / weave
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE") and k != "PYTHONPATH"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    env.update(OMP_NUM_THREADS="1", AUTOWEAVE="1", AUTOWEAVE_REPORT=str(out / template))
    worker = [str(ROOT / "tests" / "report_worker.py"), str(out), weave]
    if spawn:
        cmd = [sys.executable, *worker, "--spawn"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker]
    # gloo's teardown race can abort a rank after its work (pytorch#190489): run again once.
    proc = run_ranks(cmd, env, timeout=600, cwd=tmp)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return out, proc.stderr


def _reports(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("r*.json"))}


def _check_on(out: Path, log: str) -> None:
    reports = _reports(out)
    assert sorted(reports) == ["r0.json", "r1.json"]  # nothing extra from a launcher
    for rank in range(2):
        data = reports[f"r{rank}.json"]
        cap = json.loads((out / f"capture{rank}.json").read_text())
        assert (data["rank"], data["world_size"]) == (rank, 2)
        assert data["ac_fallbacks"]["count"] == 0
        assert data["totals"]["graphs"] == cap["graphs"] > 0
        assert data["totals"]["ops"] == cap["ops"] > 0
        assert data["totals"]["woven"] == 3 and len(data["plans"]) == 4
    assert log.count("autoweave plan: 4 compiled modules, 3 woven") == 1  # rank 0 only, once
    assert "layers.1.moe.experts [FSDPGroupedExperts] boundary: FSDP unit (fully_shard)" in log
    # One summary, rank 0's: no "rank 0 of 1" from a launcher or a spawning parent.
    assert log.count("autoweave report (") == 1
    assert f"autoweave report (rank 0 of 2) -> {out / 'r0.json'}" in log


@pytest.mark.slow
def test_report_under_torchrun_one_file_per_rank_and_fallback_only_without_autoweave(tmp_path: Path) -> None:
    out, log = _run_job(tmp_path, "on", "r{rank}.json")
    _check_on(out, log)
    # Without {rank} only global rank 0 writes; the launcher (rank 0 of nothing) does not.
    out, log = _run_job(tmp_path, "off", "report.json")
    assert sorted(p.name for p in out.glob("*.json")) == ["capture0.json", "capture1.json", "report.json"]
    data = json.loads((out / "report.json").read_text())
    assert (data["rank"], data["world_size"]) == (0, 2)
    assert data["ac_fallbacks"]["count"] > 0 and data["totals"]["woven"] == 0
    assert log.count("autoweave report (") == 1 and "checkpointed region(s) fell back to eager" in log


@pytest.mark.slow
def test_report_under_mp_spawn_knows_each_rank(tmp_path: Path) -> None:
    out, log = _run_job(tmp_path, "on", "r{rank}.json", spawn=True)
    _check_on(out, log)


# -- real processes: what is written and printed at exit ------------------------------------

_COMPILE_A_BLOCK = """
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from tests.models import Block
block = torch.compile(cw.checkpoint_wrapper(Block()), backend="eager")
block(torch.randn(4, 8)).sum().backward()
"""


def _python(code: str, tmp: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AUTOWEAVE") and k not in ("RANK", "WORLD_SIZE")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOWEAVE="1", **env_vars)
    prologue = "import autoweave, torch\nassert autoweave.enable()\n"
    return subprocess.run(
        [sys.executable, "-c", prologue + code], env=env, capture_output=True, text=True, timeout=300, cwd=tmp
    )


_DYNAMO_IMPORTED = """
import atexit, sys
atexit.register(lambda: print("at exit", "torch._dynamo" in sys.modules))  # first registered: runs last
import torch
print("after import torch", "torch._dynamo" in sys.modules)
import autoweave
print("autoweave on", autoweave.is_enabled())
if sys.argv[1] == "compile":
    torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.randn(2, 4))
"""


@pytest.mark.parametrize("report", [False, True])
def test_a_process_that_never_compiles_never_imports_dynamo(tmp_path: Path, report: bool) -> None:
    # Plain ``import torch`` leaves dynamo unimported (1.6 s of CPU here); autoweave on, with
    # its report listening and its exit summary, must too: dataloader workers, torchrun's
    # launcher and tools import torch and never compile. The report still counts compiles.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE") and k != "TORCH_LOGS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOWEAVE="1")
    if report:
        env["AUTOWEAVE_REPORT"] = str(tmp_path / "r.json")

    def run(what: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _DYNAMO_IMPORTED, what],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    idle, busy = run("idle"), run("compile")
    assert idle.returncode == 0 and busy.returncode == 0, idle.stderr + busy.stderr
    assert idle.stdout.split("\n")[:3] == ["after import torch False", "autoweave on True", "at exit False"]
    assert busy.stdout.split("\n")[:3] == ["after import torch False", "autoweave on True", "at exit True"]
    if report:
        dynamo = json.loads((tmp_path / "r.json").read_text())["dynamo"]
        assert dynamo["compiles"] == 1, dynamo


def test_a_process_that_compiles_nothing_writes_and_prints_nothing(tmp_path: Path) -> None:
    # torchrun's launcher: AUTOWEAVE=1 and AUTOWEAVE_REPORT inherited, torch imported, no RANK.
    template = str(tmp_path / "r{rank}.json")
    idle = _python(
        "from autoweave.observe import report\nassert report._stats is not None  # collecting\n",
        tmp_path,
        AUTOWEAVE_REPORT=template,
    )
    assert idle.returncode == 0, idle.stderr
    assert list(tmp_path.iterdir()) == [] and "autoweave" not in idle.stderr
    # The same process with one compile does write, and says so.
    busy = _python(_COMPILE_A_BLOCK, tmp_path, AUTOWEAVE_REPORT=template)
    assert busy.returncode == 0, busy.stderr
    data = json.loads((tmp_path / "r0.json").read_text())
    assert (data["rank"], data["world_size"], data["totals"]["modules"]) == (0, 1, 1)
    assert busy.stderr.count("autoweave report (rank 0 of 1)") == 1


_SWAP_STDERR = (
    """
import io, sys
sys.stderr = io.StringIO()  # a test runner's capture file
"""
    + _COMPILE_A_BLOCK
    + """
block(torch.randn(4, 8)).sum().backward()  # the next step: the plan summary is logged now, into the capture
other = torch.compile(cw.checkpoint_wrapper(Block()), backend="eager")
other(torch.randn(4, 8)).sum().backward()  # its summary waits for exit
sys.stderr, closed = sys.__stderr__, sys.stderr
closed.close()  # the runner closes its capture before atexit runs
"""
)

_CLOSE_STDERR = _COMPILE_A_BLOCK + "\nimport sys\nsys.stderr.close()\n"


@pytest.mark.parametrize("code", [_CLOSE_STDERR, _SWAP_STDERR], ids=["closed", "swapped-and-closed"])
def test_exit_output_never_raises_when_stderr_was_closed(tmp_path: Path, code: str) -> None:
    # The plan summary (pending: no second step) and the report summary both come at exit.
    err = tmp_path / "fd2.txt"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AUTOWEAVE") and k not in ("RANK", "WORLD_SIZE")
    }
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), AUTOWEAVE="1", AUTOWEAVE_REPORT=str(tmp_path / "r{rank}.json"),
    )  # fmt: skip
    # An exception escaping an atexit callback is "ignored": Python reports it to
    # sys.unraisablehook, whose default writes to the closed stderr, so nothing would
    # show and the exit status stays 0. This hook reports it on stdout instead.
    prologue = (
        "import os, sys\n"
        "sys.unraisablehook = lambda u: os.write(1, f'UNRAISABLE {u.err_msg}: {u.exc_value!r}\\n'.encode())\n"
        "import autoweave, torch\nassert autoweave.enable()\n"
    )
    with open(err, "w") as fd2:
        proc = subprocess.run(
            [sys.executable, "-c", prologue + code], env=env, stdout=subprocess.PIPE, stderr=fd2,
            text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
    output = proc.stdout + err.read_text()
    assert proc.returncode == 0, output
    for needle in ("UNRAISABLE", "Traceback", "ValueError", "Logging error", "Exception ignored"):
        assert needle not in output, output
    assert json.loads((tmp_path / "r0.json").read_text())["totals"]["modules"] >= 1
    if code is _SWAP_STDERR:  # the real stderr is open again at exit: the summary reaches it
        assert output.count("autoweave report (rank 0 of 1)") == 1, output


# -- the rank, decided late -----------------------------------------------------------------


@pytest.fixture
def fresh_rank(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(_log, "_seen", None)
    yield monkeypatch


def test_log_lines_carry_the_rank_at_the_time_of_the_record(fresh_rank, capsys) -> None:
    handler = _log._StderrHandler()
    handler.setFormatter(logging.Formatter(_log.FORMAT))
    record = logging.LogRecord("autoweave", logging.WARNING, __file__, 1, "hello", None, None)
    handler.handle(record)
    fresh_rank.setenv("RANK", "3")  # the handler was made before the rank was known
    handler.handle(record)
    assert capsys.readouterr().err.splitlines() == [
        "[autoweave rank0] WARNING hello",
        "[autoweave rank3] WARNING hello",
    ]


def test_rank_comes_from_the_process_group_and_outlives_it(fresh_rank, tmp_path: Path) -> None:
    import torch.distributed as dist

    assert (_log.rank(), _log.world_size()) == (0, 1)
    fresh_rank.setenv("RANK", "5")
    fresh_rank.setenv("WORLD_SIZE", "8")
    assert (_log.rank(), _log.world_size()) == (5, 8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert (_log.rank(), _log.world_size()) == (0, 1)  # the group wins
    finally:
        dist.destroy_process_group()
    assert (_log.rank(), _log.world_size()) == (0, 1)  # remembered: the report is written later


class _NoCheckpointBackend:
    """aot_eager, except that a graph holding a checkpoint operator fails (a piece that will not compile)."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        if any("tag_activation_checkpoint" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("this backend cannot compile a checkpoint")
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.fail_open
def test_pieces_that_run_eager_are_not_counted_as_captured(weave_on) -> None:
    """Pieces that fall back to eager under their checkpoint are reported as such, with why."""
    from tests import break_models as bm

    torch.manual_seed(0)
    report.start(None)
    blocks = [
        cw.checkpoint_wrapper(bm.GlueGemmBlock(16), context_fn=bm.POLICIES["save-matmuls"]) for _ in range(2)
    ]
    model = bm.Stack(blocks, 16)
    backend = _NoCheckpointBackend()
    for i, layer in enumerate(model.layers):
        autoweave.set_mode(layer, strategy="pieces")  # kept: under auto the block would move to hoist
        model.layers[i] = torch.compile(layer, backend=backend)
    x = torch.randn(8, 16)
    for _ in range(3):
        model(x).sum().backward()
    eager_gemms = forward_gemms_outside_graphs(model, x)
    data = report.stop()
    woven = [r for r in data["regions"] if r["kind"] == "woven"]
    assert woven and sum(r["eager_graphs"] for r in woven) >= 2, woven
    assert data["totals"]["eager_graphs"] == sum(r["eager_graphs"] for r in woven)
    # What ran eager is not in the captured count: the captured graphs hold no GEMM of the
    # blocks, and every block GEMM ran eager.
    assert eager_gemms > 1
    reasons = [why for r in woven for why in r["eager_reasons"]]
    assert any(
        "ran eager under its checkpoint" in why and "cannot compile a checkpoint" in why for why in reasons
    )
    summary_text = report_exit.format_exit_summary(data, None)
    assert "not captured:" in summary_text and "ran eager" in summary_text
    # The headline, measured from autograd's record of one call per compiled module, against the
    # profiler's count of the same forward (which also counts the head, outside every compile).
    assert data["measured"]["modules"] == 2, data["measured"]
    assert data["measured"]["eager_gemms"] == eager_gemms - 1, (data["measured"], eager_gemms)
    assert data["measured"]["fully_compiled"] == 0
    assert "forward GEMMs ran outside compiled graphs" in summary_text


def test_regions_of_a_plan_given_up_since_are_not_live(weave_on) -> None:
    torch.manual_seed(0)
    report.start(None)
    block = cw.checkpoint_wrapper(Block(dim=10))  # a size no other test compiles
    model = torch.compile(block, backend="aot_eager")
    x = torch.randn(4, 10)
    model(x).sum().backward()
    before = [r for r in report._stats.snapshot()["regions"] if r["kind"] == "woven"]
    # The tree changes (a child registered): re-planned at the next call, on new regions.
    block._checkpoint_wrapped_module.extra = nn.Identity()
    model(x).sum().backward()
    data = report.stop()
    old = {r["label"] for r in before}
    regions = {r["label"]: r for r in data["regions"] if r["kind"] == "woven"}
    assert before and all(r["live"] for r in before), before
    dropped = {label for label in old if "Block" in label}  # the block's region; its experts' is reused
    assert dropped and not any(regions[label]["live"] for label in dropped), regions
    assert any(r["live"] for label, r in regions.items() if label not in old), regions
    assert data["totals"]["graphs"] == sum(r["graphs"] for r in data["regions"] if r["live"])


def test_measuring_under_an_eager_selective_checkpoint_changes_nothing(weave_on) -> None:
    """The report's measure runs inside the user's eager SAC when the AC stays outside the compile.

    It must run no op there: SAC's recompute would meet an op its forward did not see (NeMo's full
    AC with AUTOWEAVE_REPORT failed in backward so).
    """
    from tests import break_models as bm

    def build():
        torch.manual_seed(0)
        layers = nn.ModuleList(
            cw.checkpoint_wrapper(Block(dim=12, moe=i > 0), context_fn=bm.wrapped_context_fn)
            for i in range(2)
        )
        for wrapper in layers:
            wrapper._checkpoint_wrapped_module.compile(backend="aot_eager")
        return layers

    def train(layers):
        return train_chain(layers, 12, 3)

    quiet = train(build())
    torch._dynamo.reset()
    report.start(None)
    observed = train(build())
    data = report.stop()
    assert observed == quiet
    assert data["measured"]["modules"] == 2, data["measured"]


class _TwoUnits(nn.Module):
    """Two boundaries in a row: the frame between them holds no op, yet recompiles for a new size."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.first, self.second = make_break(Experts(dim)), make_break(Experts(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(self.first(self.norm(x)))


@pytest.mark.parametrize("reset", ["torch.compiler.reset", "torch._dynamo.reset"])
def test_the_report_stays_true_across_resets_and_regions_add_up_to_dynamo(weave_on, reset: str) -> None:
    torch.manual_seed(0)
    report.start(None)
    model = nn.Sequential(
        *[torch.compile(cw.checkpoint_wrapper(_TwoUnits()), backend="aot_eager") for _ in range(2)]
    )

    def steps() -> None:
        for rows in (4, 4, 6, 7):  # new sizes: every frame of the regions recompiles
            model(torch.randn(rows, 8)).sum().backward()

    steps()
    before = report._stats.snapshot()
    # What frameworks call between train and eval: dynamo forgets every compile and its callbacks.
    {"torch.compiler.reset": torch.compiler.reset, "torch._dynamo.reset": torch._dynamo.reset}[reset]()
    steps()  # compiled all over again
    data = report.stop()

    first, total = before["dynamo"], data["dynamo"]
    assert first["recompiles"] > 0, first
    # After the reset the same compiles happen again, and the report hears every one.
    assert (total["compiles"], total["recompiles"]) == (2 * first["compiles"], 2 * first["recompiles"])
    assert total["compile_s"] > first["compile_s"]
    woven = [r for r in data["regions"] if r["kind"] == "woven"]
    # Each compile of a woven region's frames (its resume functions, the frames it calls) is the
    # region's, whether or not dynamo handed the backend a graph: the regions add up to dynamo.
    assert sum(r["compiles"] for r in woven) == total["compiles"], woven
    assert sum(r["recompiles"] for r in woven) == total["recompiles"], woven


def _pass_on(experts: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Not the region's code: a break in the call below makes dynamo compile this function as a
    # frame of its own, with no op of its own (no graph), which recompiles for a new size.
    return experts(x)


class _Routed(nn.Module):
    """A block whose boundary is reached through a helper function (an MoE's dispatch)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = make_break(Experts(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _pass_on(self.experts, self.norm(x))


def test_frames_a_region_calls_count_under_it(weave_on) -> None:
    torch.manual_seed(0)
    report.start(None)
    model = nn.Sequential(
        *[torch.compile(cw.checkpoint_wrapper(_Routed()), backend="aot_eager") for _ in range(2)]
    )
    for rows in (4, 4, 6, 7):  # token counts that change from step to step
        model(torch.randn(rows, 8)).sum().backward()
    data = report.stop()
    total = data["dynamo"]
    assert total["recompiles"] > 0, total
    woven = [r for r in data["regions"] if r["kind"] == "woven"]
    assert sum(r["compiles"] for r in woven) == total["compiles"], (woven, total)
    assert sum(r["recompiles"] for r in woven) == total["recompiles"], (woven, total)
    assert total["outside_regions"] == {"compiles": 0, "recompiles": 0}, total


def test_compiles_outside_every_region_are_counted_apart(weave_on) -> None:
    # A function the application compiles itself (NeMo compiles its own norm and activation):
    # dynamo's, not any region's; the regions and outside_regions add up to dynamo's.
    report.start(None)
    model = torch.compile(cw.checkpoint_wrapper(_Routed()), backend="aot_eager")
    scale = torch.compile(lambda t: t * 2.0, backend="eager")
    for rows in (4, 6, 7):
        scale(model(torch.randn(rows, 8))).sum().backward()
    data = report.stop()
    total = data["dynamo"]
    outside = total["outside_regions"]
    assert outside["compiles"] >= 1, total
    regions = data["regions"]
    assert sum(r["compiles"] for r in regions) + outside["compiles"] == total["compiles"], (regions, total)
    assert sum(r["recompiles"] for r in regions) + outside["recompiles"] == total["recompiles"], (
        regions,
        total,
    )


def _measured_under(stances: list[str]) -> dict:
    """The report of three checkpointed blocks, compiled one by one, trained a step per stance."""
    torch._dynamo.reset()
    _state.reset()
    torch.manual_seed(0)
    report.start(None)
    model = Stack(n=2)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    x = torch.randn(4, 8)
    for stance in stances:
        with torch.compiler.set_stance(stance):
            model(x).sum().backward()
    return report.stop()


def test_a_step_under_a_stance_that_forces_eager_is_not_the_steady_state(weave_on) -> None:
    steady = _measured_under(["default", "default", "default"])
    assert steady["measured"]["modules"] == 3 and steady["measured"]["eager_gemms"] == 0, steady["measured"]
    # A step run eager on purpose (an eval, a debug step) between compiled ones: the measure
    # waits for the next step that may run compiled, and finds what the steady state runs.
    for stances in (
        ["default", "force_eager", "default"],
        ["force_eager", "force_eager", "default"],
        ["eager_on_recompile", "eager_on_recompile", "default"],  # nothing cached yet: eager
    ):
        data = _measured_under(stances)
        assert data["measured"] == steady["measured"], (stances, data["measured"])


def test_only_steps_that_were_forced_eager_leave_the_steady_state_unmeasured(weave_on) -> None:
    data = _measured_under(["force_eager", "force_eager", "force_eager"])
    assert data["measured"]["modules"] == 0, data["measured"]
    assert data["measured"]["not_measured"] == {"force_eager": 3}, data["measured"]
    assert all(p["measured"] is None for p in data["plans"])
    text = report_exit.format_exit_summary(data, None)
    assert "forward GEMMs ran outside compiled graphs" not in text
    assert (
        "not measured: every call of 3 module(s) ran under torch.compiler.set_stance('force_eager')" in text
    )
