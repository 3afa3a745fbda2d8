"""The local launcher: torchrun-style environment, first failure wins, nothing left running."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerobubble.runtime import progress
from zerobubble.runtime.launcher import (
    LaunchError,
    _stalled,
    _waited_on,
    init_distributed,
    launch,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def report_env() -> dict:
    import torch

    keys = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "OMP_NUM_THREADS",
    )
    return {**{k: os.environ[k] for k in keys}, "threads": torch.get_num_threads()}


def fail_on_rank_one(piddir: str) -> None:
    rank = int(os.environ["RANK"])
    Path(piddir, str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(0.2)
        raise ValueError("boom from rank 1")
    if rank == 2:
        os._exit(7)
    time.sleep(60)


def sleep_forever(piddir: str) -> None:
    Path(piddir, os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(60)


def assert_all_dead(piddir: Path, n: int) -> None:
    pids = [int(p.read_text()) for p in sorted(piddir.iterdir())]
    assert len(pids) == n
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_launch_sets_the_torchrun_environment(method):
    multiprocessing.set_forkserver_preload(["torch"])  # the forkserver ranks have it at start
    results = launch(report_env, 2, timeout=60, start_method=method)
    for rank, env in enumerate(results):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1" and env["threads"] == 1


def tensors_of_this_rank() -> dict:
    import torch

    rank = int(os.environ["RANK"])
    x = torch.arange(6.0).view(2, 3) + rank
    return {"x": x, "view": x[:, 1:], "grad": torch.ones(2, requires_grad=True) * 2}


def an_unpicklable_result():
    return lambda: None


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_results_holding_tensors_come_back_by_value(method):
    import torch

    multiprocessing.set_forkserver_preload(["torch"])
    results = launch(tensors_of_this_rank, 2, timeout=60, start_method=method)
    for rank, got in enumerate(results):
        x = torch.arange(6.0).view(2, 3) + rank
        assert torch.equal(got["x"], x) and torch.equal(got["view"], x[:, 1:])
        assert torch.equal(got["grad"], torch.full((2,), 2.0)) and got["grad"].requires_grad


def test_a_result_that_does_not_pickle_fails_its_rank_saying_so():
    with pytest.raises(LaunchError) as err:
        launch(an_unpicklable_result, 1, timeout=60)
    assert err.value.failures[0].rank == 0
    assert "TypeError: rank 0: fn returned a function that cannot be pickled" in str(err.value)
    assert "return plain data" in str(err.value)


def test_first_failure_is_reported_and_the_others_are_stopped(tmp_path):
    with pytest.raises(LaunchError) as err:
        launch(fail_on_rank_one, 3, str(tmp_path), timeout=60, grace=1.0)
    failures = err.value.failures
    by_rank = {f.rank: f for f in failures}
    assert sorted(by_rank) == [0, 1, 2]
    assert "ValueError: boom from rank 1" in by_rank[1].error and by_rank[1].exitcode == 1
    assert by_rank[2].exitcode == 7 and "exited with code 7" in by_rank[2].error
    assert by_rank[0].exitcode is None and "killed 1s after rank" in by_rank[0].error
    assert failures[-1].rank == 0  # the killed rank is reported last
    assert str(err.value).startswith(f"rank {failures[0].rank} failed first")
    assert_all_dead(tmp_path, 3)


def test_overall_timeout_kills_everything(tmp_path):
    with pytest.raises(LaunchError) as err:
        launch(sleep_forever, 2, str(tmp_path), timeout=4.0)
    assert [f.rank for f in err.value.failures] == [0, 1]
    assert all("overall timeout of 4s" in f.error for f in err.value.failures)
    assert_all_dead(tmp_path, 2)


def rank_zero_dies_before_an_exchange() -> None:
    import torch

    from zerobubble.runtime.launcher import init_distributed
    from zerobubble.runtime.p2p.comm import exchange_bytes

    info = init_distributed(timeout_s=60)
    if info.rank == 0:
        os._exit(3)
    time.sleep(0.5)  # rank 0 is gone (and with it, before, the store it hosted)
    exchange_bytes(
        b"x", group=None, device=torch.device("cpu"), timeout_s=2.0, action="a test", key="t"
    )


def test_the_store_outlives_rank_zero_so_a_timeout_names_who_never_arrived():
    """The launcher hosts the job's store, as torchrun's agent does: a store hosted by rank 0
    would die with it, and rank 1 could only say that it cannot tell who arrived."""
    with pytest.raises(LaunchError) as err:
        launch(rank_zero_dies_before_an_exchange, 2, timeout=60, grace=15)
    by_rank = {f.rank: f for f in err.value.failures}
    assert by_rank[0].exitcode == 3
    assert by_rank[1].exitcode == 1, by_rank[1].error
    assert "rank 0 never arrived (stalled or dead)" in by_rank[1].error, by_rank[1].error


def test_a_start_method_other_than_spawn_or_forkserver_is_refused():
    with pytest.raises(
        ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"
    ):
        launch(report_env, 2, start_method="fork")


LAUNCHER = """
import sys
from test_launcher import sleep_forever
from zerobubble.runtime.launcher import launch
if __name__ == "__main__":
    launch(sleep_forever, 2, sys.argv[1], timeout=60, start_method=sys.argv[2])
"""


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaps counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_exit_when_the_launcher_is_killed(tmp_path, method):
    script, piddir = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(LAUNCHER)
    piddir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, str(script), str(piddir), method], env=env)
    deadline = time.monotonic() + 60
    while sum(p.stat().st_size > 0 for p in piddir.iterdir()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.05)  # the pid files are written in one call; let the last one finish
    pids = [int(p.read_text()) for p in piddir.iterdir()]
    proc.kill()
    proc.wait()
    assert len(pids) == 2, "the ranks did not start"
    deadline = time.monotonic() + 10
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(gone, pids)), f"ranks {pids} outlived their launcher"


def abort_in_native_code_on_rank_one() -> None:
    """Rank 1 dies of SIGABRT, as a heap check in native code kills a process."""
    if int(os.environ["RANK"]) == 1:
        os.abort()


def test_a_rank_killed_by_a_fatal_signal_reports_its_python_stack():
    with pytest.raises(LaunchError) as err:
        launch(abort_in_native_code_on_rank_one, 2, timeout=60, grace=2.0)
    (failure,) = [f for f in err.value.failures if f.rank == 1]
    assert failure.exitcode == -6, str(err.value)
    head, _, stack = failure.error.partition("\n")
    assert head == "killed by signal SIGABRT; its Python stack when the signal arrived:"
    assert "in abort_in_native_code_on_rank_one" in stack, stack
    assert "Fatal Python error: Aborted" in stack, stack


ABORT = """
import os
if os.environ["RANK"] == "1":
    os.abort()
"""


def test_script_ranks_print_their_python_stack_on_a_fatal_signal(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(ABORT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("PYTHONFAULTHANDLER", None)
    cmd = [sys.executable, "-m", "zerobubble.launch", "-n", "2", "--grace", "1", str(script)]
    proc = subprocess.run(cmd, env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 134, proc.stderr
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr
    assert f'File "{script}", line 4 in <module>' in proc.stderr, proc.stderr


def test_init_distributed_explains_a_missing_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match=r"RANK.*python -m zerobubble.launch -n P"):
        init_distributed()


SCRIPT = """
import os, sys
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[1], f"rank{rank}"), "w") as f:
    f.write(" ".join([os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], *sys.argv[2:]]))
sys.exit(int(sys.argv[2]) if rank == 1 else 0)
"""


def test_module_entry_point_runs_a_script(tmp_path):
    """Rank 1 exits 3: the job exits 3, and both ranks saw the same world and port. (A clean
    exit 0 through the entry point is asserted by test_example_trains_with_the_same_losses
    and test_a_script_rank_destroys_its_process_group_at_a_clean_exit_only[return].)"""
    code = 3
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "zerobubble.launch", "-n", "2", "--grace", "1"]
    proc = subprocess.run([*cmd, str(script), str(tmp_path), str(code)], env=env, timeout=60)
    assert proc.returncode == code
    seen = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    assert seen[0][0] == seen[1][0] == "2" and seen[0][1] == seen[1][1]  # same world and port
    assert seen[0][2:] == [str(code)]


def test_example_trains_with_the_same_losses_on_any_number_of_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    example = str(ROOT / "examples" / "train_gpt_zb.py")
    outputs = []
    for n in ("1", "2"):
        cmd = [sys.executable, "-m", "zerobubble.launch", "-n", n, example, "--steps", "2"]
        proc = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        outputs.append([line.split(" (")[0] for line in proc.stdout.splitlines()])
    assert outputs[0] == outputs[1]  # the pipeline computes exactly the single-rank math
    assert [line.split(":")[0] for line in outputs[0]] == ["step 0", "step 1"]


# A neighbour that fails on the dead rank's closed connection ends within a few
# milliseconds of it: within one polling window, where a poll loop sees ranks in index order.
def neighbours(port: int) -> None:
    """Rank P-2 connects to every other rank and SIGKILLs itself; the others fail as soon
    as they see its connection close."""
    import signal
    import socket

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == world - 2:
        conns = []
        for r in (r for r in range(world) if r != rank):
            for _ in range(500):
                try:
                    conns.append(socket.create_connection(("127.0.0.1", port + r)))
                    break
                except ConnectionRefusedError:
                    time.sleep(0.01)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    with socket.create_server(("127.0.0.1", port + rank)) as srv:
        conn, _ = srv.accept()
        conn.recv(1)  # b"": the victim is gone
    raise ConnectionError(f"rank {rank}: peer rank {world - 2} closed the connection")


# The script carries neighbours' source: importing it from this module would import pytest
# in every rank, a second of start-up each on a loaded machine, four times per world.
NEIGHBOURS = f"""
import os, sys, time
{inspect.getsource(neighbours)}
try:
    neighbours(int(sys.argv[1]))
except ConnectionError:
    os._exit(1)
"""


def test_script_launcher_blames_the_rank_that_died_first(tmp_path):
    """Four ranks, the victim rank 2: neighbours below it (ranks 0, 1, which a poll loop in
    index order sees first) and above it (rank 3). Four runs, as the race needs; a world of
    three (one neighbour each side) adds no case and is not run."""
    world = 4
    script = tmp_path / "job.py"
    script.write_text(NEIGHBOURS)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    victim = world - 2
    for _ in range(4):
        cmd = [sys.executable, "-m", "zerobubble.launch", "-n", str(world), "--grace", "2"]
        proc = subprocess.run(
            [*cmd, str(script), str(free_ports(world))],
            env=env,
            timeout=60,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 137, proc.stderr
        want = f"rank {victim} failed first: it was killed by signal SIGKILL (status 137)"
        assert want in proc.stderr, proc.stderr
        assert proc.stderr.rstrip().endswith("job exit status 137"), proc.stderr


def test_launch_orders_failures_by_time_of_death():
    """As above, through launch(): four ranks, neighbours on both sides of the victim."""
    world = 4
    victim = world - 2
    for _ in range(3):
        with pytest.raises(LaunchError) as err:
            launch(
                neighbours,
                world,
                free_ports(world),
                timeout=60,
                grace=2.0,
                start_method="forkserver",
            )
        failures = err.value.failures
        assert failures[0].rank == victim and failures[0].exitcode == -9, str(err.value)
        assert failures[0].error == "killed by signal SIGKILL"
        assert sorted(f.rank for f in failures) == list(range(world))
        assert all(f.exitcode == 1 for f in failures[1:]), str(err.value)
        assert str(err.value).startswith(f"rank {victim} failed first (exit -9)")


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive ports free a moment ago."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError("no run of free ports found")


def test_progress_marks_name_the_running_rank_the_first_failure_waited_on(tmp_path):
    """The stall rule on marks written here (no launch): the rank that failed first died
    waiting on rank 1, which waited on rank 2, alive and running: rank 2 is named."""
    marks = {r: progress.Progress(tmp_path / str(r)) for r in range(3)}
    assert progress.read(tmp_path, 4).keys() == {0, 1, 2}  # rank 3 never marked
    assert all(m.state == progress.RUNNING for m in progress.read(tmp_path, 3).values())
    marks[0].waiting(1)
    marks[1].waiting(2)
    got = progress.read(tmp_path, 3)
    assert (got[0].state, got[1].state) == (1, 2)
    stall = _stalled(0, {0: 1}, [1, 2], got)
    assert stall is not None and stall[0] == 2
    assert stall[1].endswith("while rank 0 died waiting on it"), stall
    assert _stalled(0, {0: -9}, [1, 2], got) is None  # a signal death is the cause itself
    timeout = _stalled(None, {}, [0, 1, 2], got)  # the overall timeout, ranks 0, 1 waiting
    assert timeout is not None and timeout[0] == 2 and timeout[1].endswith("while rank 0 waits")
    marks[0].running()  # failed in its own code, not waiting: it is the cause
    assert _stalled(0, {0: 1}, [1, 2], progress.read(tmp_path, 3)) is None
    marks[0].waiting(None)  # a collective names no peer: the running rank is named
    assert _stalled(0, {0: 1}, [1, 2], progress.read(tmp_path, 3))[0] == 2


def test_a_rank_waited_on_that_failed_later_in_its_own_code_is_named_first(tmp_path):
    """Rank 0 died first, waiting on rank 1, which waited on rank 2; rank 2 died later,
    running (not waiting) with its own error: it is the cause (an overlapped pair's main
    thread that gave up on its stuck helper). Not so when it was killed by a signal (the
    signal rule orders it), or when it waited itself; a chain that ends in a collective
    names the one rank that raised while running, if only one did."""
    marks = {r: progress.Progress(tmp_path / str(r)) for r in range(3)}
    marks[0].waiting(1)
    marks[1].waiting(2)
    got = progress.read(tmp_path, 3)
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, got) == 2
    assert _waited_on([0, 2, 1], {0: 1, 1: 1, 2: 1}, got) == 2
    assert _waited_on([0, 1], {0: 1, 1: 1}, got) is None  # rank 2 did not fail
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: -9}, got) is None
    marks[2].waiting(None)
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, progress.read(tmp_path, 3)) is None
    marks[2].running()
    marks[1].waiting(None)  # rank 0 waited on rank 1, which waited in a collective
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, progress.read(tmp_path, 3)) == 2
    marks[1].running()  # the one rank 0 waited on raised while running
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, progress.read(tmp_path, 3)) == 1
    marks[0].waiting(None)  # in a collective, and two ranks raised while running: no cause
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, progress.read(tmp_path, 3)) is None
    marks[0].running()  # the first failed in its own code: the cause itself
    assert _waited_on([0, 1, 2], {0: 1, 1: 1, 2: 1}, progress.read(tmp_path, 3)) is None


EXIT_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
import zerobubble

def report():  # registered first, so it runs after init_distributed's own handler
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w") as f:
        f.write(str(dist.is_initialized()))

atexit.register(report)
zerobubble.init_distributed()
dist.barrier()
if sys.argv[2] == "raise" and dist.get_rank() == 1:
    raise RuntimeError("boom")
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_script_rank_destroys_its_process_group_at_a_clean_exit_only(tmp_path, how):
    """Left to interpreter finalisation, gloo can abort a finished rank; after an unhandled
    exception the group is left alone (work may be pending on dead peers)."""
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "zerobubble.launch", "-n", "2", "--grace", "5"]
    proc = subprocess.run([*cmd, str(script), str(tmp_path), how], env=env, timeout=120)
    assert proc.returncode == (0 if how == "return" else 1)
    assert (tmp_path / "rank1").read_text() == str(how == "raise")
