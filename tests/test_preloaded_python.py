"""The preloaded Python (tests/preloaded_python.py) runs a script as a fresh `python` does: the
same arguments, folder, import path, environment, `__main__`, output, exit status and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from .conftest import FRESH_PYTHON, SUBPROCESS_ENV, python_process, run_python, shell_env
from .preloaded_python import PreloadedPopen, PreloadedPython

pytestmark = pytest.mark.skipif(FRESH_PYTHON, reason="KILN_TESTS_FRESH_PYTHON=1: none preloaded")

SCRIPT = """
import json, os, sys
print(json.dumps({
    "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "first": sys.path[0],
    "file": __file__, "doc": __doc__, "loader": type(__loader__).__name__,
    "plugin": sys.path[1] if os.environ.get("PYTHONPATH") else None,
    "env": os.environ.get("KILN_SEEN"), "stdin": sys.stdin.read(),
}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["raise"]:
    raise ValueError("the last line")
if sys.argv[1:] == ["wait"]:
    import time
    print("waiting", flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def fresh(cmd, cwd, env=SUBPROCESS_ENV, input=""):
    return subprocess.run(cmd, cwd=cwd, env=env, input=input, capture_output=True, text=True)


@pytest.mark.parametrize("args", [[], ["3"], ["raise"]], ids=["exits 0", "exits 3", "raises"])
def test_a_script_sees_and_ends_as_in_a_fresh_interpreter(script, tmp_path, args):
    cmd = [sys.executable, str(script), *args]
    env = {**SUBPROCESS_ENV, "KILN_SEEN": "yes", "PYTHONPATH": str(tmp_path)}
    preloaded = run_python(cmd, tmp_path, env, input="typed")
    assert preloaded.args == cmd
    expected = fresh(cmd, tmp_path, env, input="typed")
    assert (preloaded.returncode, preloaded.stdout) == (expected.returncode, expected.stdout)
    said = json.loads(preloaded.stdout)
    assert said["name"] == "__main__" and said["argv"] == [str(script), *args]
    assert said["first"] == str(script.parent) and said["plugin"] == str(tmp_path)
    assert said["env"] == "yes" and said["stdin"] == "typed"
    assert preloaded.stderr.splitlines()[-1] == expected.stderr.splitlines()[-1]


def test_a_script_named_from_its_folder_knows_its_absolute_path(script, tmp_path):
    """`python scripts/bench_peers.py` started itself again from another folder through its
    __file__: the interpreter makes it absolute, runpy.run_path kept it as typed."""
    cmd = [sys.executable, "scripts/probe.py"]
    preloaded, expected = run_python(cmd, tmp_path), fresh(cmd, tmp_path)
    assert (preloaded.returncode, preloaded.stdout) == (expected.returncode, expected.stdout)
    said = json.loads(preloaded.stdout)
    assert said["file"] == str(script) and said["argv"] == ["scripts/probe.py"]


def test_a_module_runs_as_python_dash_m_does(tmp_path):
    (tmp_path / "probe_module.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "probe_module", "5"]
    preloaded, expected = run_python(cmd, tmp_path), fresh(cmd, tmp_path)
    assert (preloaded.returncode, preloaded.stdout) == (expected.returncode, expected.stdout) != 0
    assert json.loads(preloaded.stdout)["argv"][0] == str(tmp_path / "probe_module.py")


def test_a_signal_reaches_the_child_and_its_status_comes_back(script, tmp_path):
    process = python_process([sys.executable, str(script), "wait"], tmp_path)
    assert isinstance(process, PreloadedPopen)
    assert process.stdout.readline().startswith("{")
    assert process.stdout.readline() == "waiting\n"
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM
    assert "to stderr" in err


def test_an_environment_torch_imports_differently_starts_a_fresh_interpreter(script, tmp_path):
    threads = {**SUBPROCESS_ENV, "OMP_NUM_THREADS": "2"}
    process = python_process([sys.executable, str(script)], tmp_path, threads)
    assert not isinstance(process, PreloadedPopen)
    process.communicate(timeout=60)
    assert process.returncode == 0


def test_torchrun_s_ranks_are_children_of_it_too(tmp_path):
    """torchrun's ranks: `python -u script.py` with PYTHON_EXEC (what python_process and
    shell_env tell torchrun: the server's `python`; -u as PYTHONUNBUFFERED does), and scripts/
    matrix.py's `--no-python python train.py`. What torchrun tells its ranks (TORCHELASTIC_*,
    TORCH_NCCL_*) is read when they run, not when torch is imported: each rank is a child of
    the preloaded Python (torch imported as it starts), with its own rank; a variable torch's
    import reads still starts a fresh one."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import json, os, sys\n"
        "print(json.dumps([os.environ['RANK'], 'torch' in sys.modules]), flush=True)\n"
    )
    torchrun = "python -m torch.distributed.run --standalone --nproc_per_node=2"
    preloaded = [["0", True], ["1", True]]  # each rank: its RANK, torch imported as it starts
    for line in (f"{torchrun} {rank}", f"{torchrun} --no-python python {rank}"):
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=shell_env(SUBPROCESS_ENV),
            text=True,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        said = done.stdout.splitlines()
        assert sorted(json.loads(s) for s in said if s.startswith("[")) == preloaded
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = run_python([*launcher, "--nproc_per_node=2", rank], tmp_path, timeout=120)
    said = done.stdout.splitlines()
    assert sorted(json.loads(s) for s in said if s.startswith("[")) == preloaded
    told = {"RANK": "0", "TORCHELASTIC_RUN_ID": "none", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    read_at_import = {**told, "TORCH_SHOW_CPP_STACKTRACES": "1"}
    for env, forked in ((told, True), (read_at_import, False)):
        process = python_process([sys.executable, str(rank)], tmp_path, {**SUBPROCESS_ENV, **env})
        assert isinstance(process, PreloadedPopen) == forked
        process.communicate(timeout=60)
        assert process.returncode == 0


def test_children_running_side_by_side_each_get_their_own_status(script, tmp_path):
    children = [python_process([sys.executable, str(script), str(n)], tmp_path) for n in range(4)]
    for child in reversed(children):
        child.communicate(timeout=60)
    assert [child.returncode for child in children] == [0, 1, 2, 3]


def test_a_shell_s_python_runs_a_script_through_it_and_ends_as_the_child_did(script, tmp_path):
    env = shell_env({**SUBPROCESS_ENV, "KILN_SEEN": "typed"})
    assert env["PATH"].split(os.pathsep)[0].endswith("bin")

    def shell(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", line],
            cwd=tmp_path,
            env=env,
            text=True,
            capture_output=True,
            input="from the shell",
            timeout=60,
        )

    for args in ("", " 4", " raise"):
        through, expected = (
            shell(f"python {script}{args}"),
            fresh([sys.executable, str(script), *args.split()], tmp_path, env, "from the shell"),
        )
        assert (through.returncode, through.stdout) == (expected.returncode, expected.stdout)
        assert through.stderr.splitlines()[-1] == expected.stderr.splitlines()[-1]
    # what it cannot become (code on the command line) is the real interpreter
    assert shell("python -c 'import sys; print(sys.executable)'").stdout.strip() == sys.executable

    waiting = subprocess.Popen(
        ["bash", "-c", f"exec python {script} wait"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert waiting.stdout.readline().startswith("{") and waiting.stdout.readline() == "waiting\n"
    waiting.send_signal(signal.SIGTERM)  # to the shell's `python`, passed on to the child
    assert waiting.wait(timeout=30) == -signal.SIGTERM
    waiting.stdout.close()


def test_a_server_whose_imports_printed_something_hands_every_command_to_a_fresh_one():
    """A warning at `import torch` would be in every fresh interpreter's stderr, where a test
    reads it: such a server takes no command (here its imports print PYTHONVERBOSE's lines)."""
    talkative = PreloadedPython({**SUBPROCESS_ENV, "PYTHONVERBOSE": "1"})
    try:
        assert "import " in talkative.said
        assert not talkative.imported_with({**SUBPROCESS_ENV, "PYTHONVERBOSE": "1"})
        env = {**SUBPROCESS_ENV, "PATH": "/usr/bin"}
        assert talkative.shell_path(env) == "/usr/bin"
    finally:
        talkative.stop()


def test_a_server_that_cannot_start_says_so_once_and_takes_no_command(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('no torch here')\n")
    with pytest.warns(UserWarning, match="preloaded Python did not start"):
        broken = PreloadedPython({**SUBPROCESS_ENV, "PYTHONPATH": str(tmp_path)})
    try:
        assert "no torch here" in broken.said
        assert not broken.imported_with({**SUBPROCESS_ENV, "PYTHONPATH": str(tmp_path)})
    finally:
        broken.stop()
