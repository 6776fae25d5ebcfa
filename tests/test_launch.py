"""The launcher: results, failures, timeouts, concurrency, refusals, and no leftovers."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import launch_workers as w
from shardlab import checkpoint, workers
from shardlab.launch.hygiene import reclaim_run_dirs
from shardlab.launch import (LaunchError, LaunchTimeout, RankFailed, choose_placement, launch,
                             placement, resolve_backend)


def live_children() -> list[int]:
    """PIDs of every live process this test process started, however deep (zombies excluded).

    multiprocessing's resource tracker and fork server, each started once and shared by
    every launch of this process, are not processes of a launch and are left out; the
    ranks the fork server forked are counted.
    """
    return w.launch_descendants(os.getpid())


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = set(live_children())
    yield
    assert set(live_children()) - before == set(), "a process of the launch is still alive"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_results_come_back_in_rank_order(world):
    # one launch: each rank's own value, and one that all ranks computed together
    assert launch(w.rank_and_sum_of_ranks, world) == [
        (10 * r, float(sum(range(world)))) for r in range(world)]



def test_a_changed_environment_restarts_the_fork_server_once():
    """A variable that changes between launches (and stays changed, as one a library sets
    for good) gets a fork server of its own: the ranks see it, and are still forked, never
    spawned by this process (a spawned rank imports torch again: seconds per rank)."""
    name = f"SHARDLAB_TEST_{uuid.uuid4().hex[:8].upper()}"
    before = launch(w.starter_and_variable, 2, name)
    os.environ[name] = "changed"
    try:
        changed = launch(w.starter_and_variable, 2, name)
        again = launch(w.starter_and_variable, 2, name)
    finally:
        del os.environ[name]
    for results in (before, changed, again):
        assert all(starter != os.getpid() for starter, _ in results), "spawned, not forked"
        assert len({starter for starter, _ in results}) == 1, "one server per launch"
    assert [seen for _, seen in before] == [None, None]
    assert [seen for _, seen in changed + again] == ["changed"] * 4
    assert before[0][0] != changed[0][0], "the server from before the change was kept"
    assert changed[0][0] == again[0][0], "an unchanged environment restarted the server"


def test_a_function_is_found_where_its_module_was_found_after_a_chdir(tmp_path):
    """A notebook imports a helper module from its own folder (through the "" of its
    path), then changes directory: the ranks still find the module where it was found."""
    import importlib
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    package = home / f"helpers_{uuid.uuid4().hex[:8]}"
    package.mkdir(parents=True)
    elsewhere.mkdir()
    (package / "__init__.py").write_text("")
    (package / "work.py").write_text("def answer(rank_offset):\n    return 42 + rank_offset\n")
    before = os.getcwd()
    sys.path.insert(0, "")
    try:
        os.chdir(home)
        importlib.invalidate_caches()
        work = importlib.import_module(f"{package.name}.work")
        os.chdir(elsewhere)
        assert launch(work.answer, 2, 0) == [42, 42]
    finally:
        os.chdir(before)
        sys.path.remove("")

def test_backend_auto_is_gloo_without_gpus():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert launch(workers.whoami, 2) == [(0, 2, "gloo"), (1, 2, "gloo")]


def test_an_exception_names_the_rank_and_stops_the_others():
    with pytest.raises(RankFailed) as info:
        launch(w.fail_on, 4, 2, timeout=60)
    assert info.value.rank == 2
    assert "ValueError: boom from rank 2" in info.value.rank_traceback
    assert "rank 2 failed" in str(info.value)
    # where the others waited for it, from their flight recorders (PyTorch numbers a
    # group's collectives from 1)
    assert "At seq 1, rank 0 waits in all_reduce of 1 float32 from fail_on" in str(info.value)
    assert "raised before calling it" in info.value.hang.text


def test_a_hang_names_the_rank_the_collective_and_its_size():
    """Rank 0 calls one all-reduce more than rank 1: the timeout names rank 0, and the
    ranks' flight recorders (PyTorch's, on in every rank) say what it waits in (kind,
    size, dtype, sequence number) and what rank 1 ran last."""
    launch(w.rank_times_ten, 2)  # the fork server up: the timeout is the hang's alone
    with pytest.raises(LaunchTimeout) as info:
        # 15 s: on a loaded machine the ranks can take seconds to reach their third
        # all-reduce, and a timeout before it finds rank 0 between two collectives
        launch(w.one_all_reduce_more_on, 2, 0, timeout=15)
    assert info.value.unfinished == [0]
    assert "ranks [0] had not finished" in str(info.value)
    hang = info.value.hang
    assert (hang.cause, hang.ranks) == ("behind", [1]), str(info.value)
    waits, last = hang.sides[0], hang.sides[1]
    assert (waits.op, waits.numel, waits.dtype, waits.finished) == \
        ("all_reduce", 6, "float32", False)
    assert (waits.seq, last.seq, last.finished) == (hang.seq, hang.seq - 1, True)
    assert f"At seq {hang.seq}, rank 0 waits in all_reduce of 6 float32 from " \
        f"one_all_reduce_more_on (never finished)" in str(info.value)
    assert f"rank 1's last is seq {hang.seq - 1}, all_reduce of 6 float32" in hang.text


def test_two_launches_at_once_do_not_collide():
    results = {}

    def run(key, world):
        results[key] = launch(w.sum_of_ranks, world)

    threads = [threading.Thread(target=run, args=(k, n)) for k, n in (("a", 2), ("b", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"a": [1.0, 1.0], "b": [3.0, 3.0, 3.0]}


def test_output_is_grouped_by_rank_in_order(capfd):
    launch(w.chatty, 3, 2)
    out = capfd.readouterr().out.splitlines()
    assert out == [f"[rank {r}] line {i} of rank {r}" for r in range(3) for i in range(2)]


@pytest.mark.parametrize("world", [0, -1, 1.5, True])
def test_bad_world_sizes_are_refused(world):
    with pytest.raises(ValueError, match="world must be a whole number"):
        launch(w.sum_of_ranks, world)


def test_nccl_without_enough_gpus_is_refused_before_starting():
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(LaunchError, match="nccl"):
        resolve_backend("nccl", 64)
    with pytest.raises(ValueError, match="unknown backend"):
        launch(w.sum_of_ranks, 2, backend="mpi-please")


def test_lambdas_and_nested_functions_travel_by_value():
    from shardlab.launch import carry

    def nested(x):
        return x + 1

    fn, args, _ = carry.unpack(carry.pack(nested, (41,), {}))
    assert fn(*args) == 42
    fn, args, _ = carry.unpack(carry.pack(lambda x: 2 * x, (21,), {}))
    assert fn(*args) == 42


def test_a_closure_over_a_lock_is_refused_in_one_line_naming_it():
    lock = threading.Lock()

    def holds_the_lock():
        with lock:
            return 1

    with pytest.raises(LaunchError) as caught:
        launch(holds_the_lock, 2)
    message = str(caught.value)
    assert "\n" not in message
    assert "'lock', which" in message and "_thread.lock" in message
    assert "create it inside the function" in message
    with pytest.raises(LaunchError, match="argument 1 of 'sum_of_ranks' .*_thread.lock"):
        launch(w.sum_of_ranks, 2, lock)


def test_a_function_from_standard_input_launches_on_4_ranks(tmp_path):
    """`python - <<EOF` used to start ranks that died re-reading a `<stdin>` file. (A
    failing function carried by value: tests/test_notebook_launch.py.)"""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from shardlab.launch import launch
        def work(x):
            return dist.get_rank() * x
        print("RESULT", launch(work, 4, 10))
    """)
    done = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert "RESULT [0, 10, 20, 30]" in done.stdout, done.stderr


def test_a_function_from_a_script_main_runs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist
        from shardlab.launch import launch
        def work():
            return dist.get_rank() + 100
        if __name__ == "__main__":
            print(launch(work, 2))
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[100, 101]", done.stderr


def test_under_torchrun_the_same_worker_sees_the_environment(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from shardlab.workers import whoami
        from shardlab.launch import launch
        results = launch(whoami, None)
        import os
        if os.environ["RANK"] == "0":
            print("RESULT", results)
    """))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--standalone", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert "RESULT [(0, 2, 'gloo'), (1, 2, 'gloo')]" in done.stdout, done.stderr


def test_ctrl_c_stops_every_rank(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, os, signal, sys
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
        # Ctrl-C as a terminal delivers it, even when this test runs in a background job
        # (which starts its processes with SIGINT ignored, and Python then never raises
        # KeyboardInterrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        import launch_workers
        from shardlab.launch import launch
        if __name__ == "__main__":
            try:
                launch(launch_workers.hang_after_marking, 2, {str(tmp_path)!r}, timeout=120)
            except KeyboardInterrupt:
                alive = launch_workers.launch_descendants(os.getpid())
                print("interrupted; children alive:", alive)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"up{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the launching script did not end after Ctrl-C; its threads:\n{err}")
    assert "interrupted; children alive: []" in out


# ----------------------------------------------------------------------------- nothing left


def processes_with(token: str) -> list[int]:
    """Live processes whose environment carries `token` (every process a launch started
    inherits it, however deep)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if token.encode() in environ and status != "Z":
            found.append(int(entry.name))
    return found


def gone_within(token: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not processes_with(token):
            return True
        time.sleep(0.2)
    return not processes_with(token)


SCRIPT = """
import sys
from launch_workers import start_a_child_then
from shardlab.launch import launch
if __name__ == "__main__":
    launch(start_a_child_then, 2, "hang", sys.argv[1], timeout=120)
"""

# a notebook kernel killed between two launches: its fork server is idle
BETWEEN_LAUNCHES = """
import os, sys, time
from launch_workers import rank_times_ten
from shardlab.launch import launch
if __name__ == "__main__":
    launch(rank_times_ten, 2)
    open(os.path.join(sys.argv[1], "launched"), "w").close()
    time.sleep(600)
"""


@pytest.fixture
def script_tmp():
    """A script's temporary folder (its TMPDIR), of its own to find what it leaves, and
    short: the fork server's socket goes in a folder under it, and a socket's path is
    limited to 107 bytes (a folder under pytest's tmp_path can be longer)."""
    folder = Path(tempfile.mkdtemp(prefix="sl-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def start_script(folder: Path, source: str, tmp: Path) -> tuple[str, subprocess.Popen]:
    """Run `source` as a script that launches (its folder as its argument), its processes
    marked by a token in their environment, its temporary files in `tmp`: (token, the
    script's process)."""
    token = f"shardlab-test-{uuid.uuid4().hex}"
    script = folder / "job.py"
    script.write_text(source)
    env = {**os.environ, "SHARDLAB_TEST_TOKEN": token, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    return token, subprocess.Popen([sys.executable, str(script), str(folder)], env=env,
                                   stderr=subprocess.PIPE)


def run_dirs_of(pid: int, tmp: Path | None = None) -> set[Path]:
    return {p for p in Path(tmp or tempfile.gettempdir()).glob("shardlab-launch-*")
            if (p / "owner.pid").is_file() and (p / "owner.pid").read_text() == str(pid)}


def multiprocessing_folders(tmp: Path) -> list[Path]:
    """The folders multiprocessing made in `tmp` (the fork server's socket is in one)."""
    return sorted(tmp.glob("pymp-*"))


@pytest.mark.parametrize("moment", ["starting", "ranks-importing", "running",
                                    "between-launches"])
def test_killing_the_launching_process_leaves_nothing(tmp_path, script_tmp, moment):
    """kill -9 of the script that launched, at any moment: while it starts the ranks,
    while they import torch, while they run (and have started children of their own),
    after a launch (its fork server idle, as a notebook kernel's is when it is shut
    down). Within a few seconds no process of the launch remains, the fork server
    included, and neither its run folder (removed by the reaper, without waiting for a
    next launch) nor the folder of the fork server's socket (multiprocessing's pymp-*)."""
    token, parent = start_script(tmp_path, BETWEEN_LAUNCHES if moment == "between-launches"
                                 else SCRIPT, script_tmp)
    tmp = script_tmp
    if moment == "starting":
        deadline = time.monotonic() + 60
        while len(processes_with(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # the script and its first rank: spawning has begun
    elif moment == "ranks-importing":
        deadline = time.monotonic() + 60
        while not run_dirs_of(parent.pid, tmp) and time.monotonic() < deadline:
            time.sleep(0.05)  # the script has imported torch and begun to launch
        time.sleep(0.5)
    elif moment == "between-launches":
        deadline = time.monotonic() + 120
        while not (tmp_path / "launched").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    else:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("child*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("child*"))) == 2
    run_dirs = run_dirs_of(parent.pid, tmp)
    assert moment in ("starting", "between-launches") or run_dirs
    assert moment == "starting" or multiprocessing_folders(tmp)  # the server's socket
    assert parent.poll() is None, parent.communicate()[1]  # still running when killed
    parent.kill()
    parent.wait()
    assert gone_within(token, 10), f"left behind: {processes_with(token)}"
    assert not any(p.exists() for p in run_dirs)  # the reaper, last to end, removed it
    assert multiprocessing_folders(tmp) == []


def test_the_next_launch_reclaims_a_folder_whose_owner_is_dead(tmp_path):
    """What is left if even the reaper was killed: the next launch removes it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    mine, theirs = tmp_path / "shardlab-launch-mine", tmp_path / "shardlab-launch-theirs"
    for folder, owner in ((mine, str(os.getpid())), (theirs, dead)):
        folder.mkdir()
        (folder / "owner.pid").write_text(owner)
    assert reclaim_run_dirs(str(tmp_path)) == [theirs]
    assert mine.exists() and not theirs.exists()


SLOW_START = """
import os, sys, time
from launch_workers import rank_times_ten
from shardlab.launch import launch
if __name__ == "__mp_main__":  # a rank importing the script: start-up takes a minute
    open(os.path.join(sys.argv[1], f"starting{os.getpid()}"), "w").close()
    time.sleep(60)
if __name__ == "__main__":
    launch(rank_times_ten, 2, timeout=120)
"""


def test_ranks_still_starting_end_at_once_with_the_launching_process(tmp_path, script_tmp):
    """kill -9 of the launching script while its ranks are still starting up (importing
    torch and the script take seconds, far more on a busy machine): they end at once, not
    when they would have reached their own watchdog."""
    token, parent = start_script(tmp_path, SLOW_START, script_tmp)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("starting*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("starting*"))) == 2
    parent.kill()
    parent.wait()
    assert gone_within(token, 3), f"left behind: {processes_with(token)}"
    assert multiprocessing_folders(script_tmp) == []


def test_a_rank_that_fails_leaves_no_child_behind(tmp_path):
    with pytest.raises(RankFailed, match="started a child, then failed"):
        launch(w.start_a_child_then, 2, "raise", str(tmp_path), timeout=120)
    pids = [int(p.read_text()) for p in tmp_path.glob("child*")]
    assert pids
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}/stat").exists()
                   and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
                   for pid in pids)


def test_partials_and_callable_objects_run():
    assert launch(functools.partial(w.Scaled(10), offset=1), 2) == [1, 11]
    assert launch(w.Scaled(3), 2) == [0, 3]


def test_bound_methods_run():
    assert launch(w.Scaled(10).plus, 2, 5) == [5, 15]
    assert launch(functools.partial(w.Scaled(3).plus, 1), 2) == [1, 4]


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts_are_refused_before_starting(threads):
    with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
        launch(w.rank_times_ten, 2, threads=threads)


def test_a_script_without_a_main_guard_is_refused_in_one_line(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("from launch_workers import rank_times_ten\n"
                      "from shardlab.launch import launch\n"
                      "launch(rank_times_ten, 2)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert 'unguarded.py calls launch() (line 3) outside an `if __name__ == "__main__":`' \
        in done.stderr
    assert "bootstrapping" not in done.stderr  # no child ever started


@pytest.mark.parametrize("backend,device,world,gpus,expected", [
    ("auto", "auto", 4, 0, ("gloo", "cpu")),
    ("auto", "auto", 4, 8, ("nccl", "cuda")),
    ("auto", "auto", 4, 1, ("gloo", "cuda")),     # one GPU shared by four ranks
    ("auto", "cpu", 4, 8, ("gloo", "cpu")),
    ("gloo", "cuda", 2, 2, ("gloo", "cuda")),
    ("auto", "cuda", 1, 1, ("nccl", "cuda")),
])
def test_the_three_placements(backend, device, world, gpus, expected):
    where = choose_placement(backend, device, world, gpus)
    assert (where.backend, where.device) == expected
    assert str(world) in where.description


@pytest.mark.parametrize("backend,device,world,gpus,message", [
    ("nccl", "auto", 4, 1, "needs one GPU per rank"),
    ("nccl", "cpu", 1, 1, "runs on GPUs only"),
    ("auto", "cuda", 2, 0, "needs a GPU"),
    ("mpi", "auto", 2, 0, "unknown backend"),
    ("auto", "tpu", 2, 0, "unknown device"),
])
def test_placements_that_cannot_run_are_refused(backend, device, world, gpus, message):
    with pytest.raises((ValueError, LaunchError), match=message):
        choose_placement(backend, device, world, gpus)


def test_a_rank_reports_its_placement():
    assert launch(placement, 2) == ["gloo: 2 rank(s) on the CPU"] * 2


@pytest.mark.parametrize("how,died,said", [
    ("signal", "was killed by signal SIGKILL (from outside, or by the kernel for lack of "
               "memory?)", []),
    ("exit", "exited with code 3 without a result or an error", []),
    # a crash in native code: where Python was, from the faulthandler every rank enables
    ("segfault", "crashed in native code (signal SIGSEGV)",
     ["Segmentation fault", "in end_silently_while_the_peer_fails"]),
], ids=["signal", "exit", "segfault"])
def test_a_rank_that_ends_without_a_word_is_named_not_the_peer_it_broke(how, died, said):
    """On a loaded machine, rank 1 dies silently; rank 0's collective fails and writes
    an error, which the launcher sees first. The cause named is rank 1, whatever the
    order of arrival, in the line a command line prints (the last), with how it died; the
    recorders' paragraph says the death first, where rank 0 waited, and gives no advice
    meant for ranks whose code took different paths. The load and what rank 1 left are
    gone with the launch."""
    with pytest.raises(RankFailed) as info:
        launch(w.end_silently_while_the_peer_fails, 2, how, timeout=120)
    failed = info.value
    assert failed.rank == 1, str(failed)
    assert failed.died == {1: died}
    assert failed.rank_traceback.strip().splitlines()[-1].startswith(f"rank 1 {died}")
    for words in said:
        assert words in failed.rank_traceback, failed.rank_traceback
    assert (failed.hang.cause, failed.hang.ranks) == ("died", [1]), str(failed)
    assert failed.hang.text.startswith(f"Rank 1 {died}")
    assert "rank 0 waited in seq 2 of group '0', all_reduce of 1 float32" in failed.hang.text
    assert "behind" not in str(failed) and "branch" not in str(failed)


def test_killing_a_training_command_leaves_no_folder(tmp_path, script_tmp):
    """`python -m shardlab train` (its progress file and the ranks' flight recorders in
    folders of their own, beside the launch's) killed by SIGKILL while it trains: every
    folder goes with the reaper, and the checkpoint folder's lock with the process."""
    token = f"shardlab-test-{uuid.uuid4().hex}"
    ckpt, tmp = tmp_path / "ckpt", script_tmp
    train = subprocess.Popen(
        [sys.executable, "-m", "shardlab", "train", "--steps", "100000", "--seq-len", "16",
         "--no-memory", "--no-ledger", "--save-every", "1", "--checkpoint-dir", str(ckpt)],
        env={**os.environ, "SHARDLAB_TEST_TOKEN": token, "TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(ckpt.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.1)  # training: a save has begun
    folders = run_dirs_of(train.pid, tmp)
    assert len(folders) == 3, folders  # the launch's, the progress file's, the flight's
    train.kill()
    train.wait()
    assert gone_within(token, 10), f"left behind: {processes_with(token)}"
    assert not any(p.exists() for p in folders)
    assert multiprocessing_folders(tmp) == []
    with checkpoint.writer_lock(ckpt):  # free: its holder is gone
        pass


class Ended:
    """A rank's process as `the_cause` reads it: an exit code, known from `after` on."""

    def __init__(self, exitcode, after: float = 0.0):
        self._exitcode, self._known = exitcode, time.monotonic() + after

    @property
    def exitcode(self):
        return self._exitcode if time.monotonic() >= self._known else None


def test_the_cause_is_the_rank_that_ended_silently_whenever_its_end_is_seen(tmp_path):
    """The rule alone, without timing: rank 0 wrote an echo (its collective lost a peer);
    rank 1 was killed, its end seen at once, or only 0.3 s after the echo (a busy
    machine); rank 2 is still running. Rank 1 is named either way; a rank that raised
    an error of its own is named by its error when no rank ended silently."""
    from shardlab.launch.blame import the_cause
    from shardlab.launch.hygiene import RankProcess
    (tmp_path / "rank0.error").write_text("RuntimeError: Connection closed by peer\n")
    for after in (0.0, 0.3):
        ranks = [RankProcess(0, Ended(1)), RankProcess(1, Ended(-9, after)),
                 RankProcess(2, Ended(None))]
        cause = the_cause(ranks, tmp_path)
        assert cause.rank == 1 and "rank 1 was killed by signal SIGKILL" in cause.rank_traceback
        assert "rank 0 then failed in its collectives" in cause.rank_traceback
        assert list(cause.died) == [1]
    ranks = [RankProcess(0, Ended(1)), RankProcess(1, Ended(None))]
    (tmp_path / "rank0.error").write_text("ValueError: a bad option\n")
    assert the_cause(ranks, tmp_path).rank == 0  # not an echo: named without waiting
