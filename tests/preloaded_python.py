"""`python train.py ...` as the tests start it, from an interpreter that has imported torch.

Every fresh Python a test starts pays `import torch` first: 2.3-3.3 CPU-s on the 2-core test
machines, most of a short train.py or infer.py run, and about a third of the default suite's
CPU over its ~150 processes (torchvision's import, for any image model, as much again). A
preloaded Python (one per pytest worker) imports torch, torchvision and Hydra once and forks
a child for each command; the child is a process like any other (its own pid, signals
and exit status, the test's pipes as its stdin/stdout/stderr, its own cwd and environment) and
runs the script as `python script.py` would, as `__main__`, with Python's own handling of its
exit (SystemExit, a traceback and exit 1, atexit handlers, files flushed).

What it cannot give is a fresh interpreter, so it is only for commands whose start is not what a
test checks: anything about imports, start-up time or memory, `python -c` code, a signal during
the imports, starts a real interpreter (`subprocess`). An environment that differs from the
preloaded one in a variable read while torch is imported (threads, allocators, CUDA, Python's
own) starts a real one too (`imported_with`)."""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import warnings

# Read while `import torch` runs (OpenMP and BLAS thread pools, allocators, torch's and CUDA's
# own switches, the interpreter's flags): a child whose environment differs in one of them
# would not be the process `python` gives; such a command starts a real interpreter.
READ_AT_IMPORT = (
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
    "LD_",
    "MALLOC_",
    "PYTHON",
)
# ... except these, read later, when a command uses them (the import path, torch.hub's cache,
# the interpreter torchrun starts its ranks with, what it tells them: their run, restarts and
# NCCL's error handling)
READ_LATER = {"PYTHONPATH", "TORCH_HOME", "PYTHON_EXEC"}
READ_LATER_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")


def imported_alike(env: dict, imported: dict) -> bool:
    """Whether `env` agrees with `imported` (the server's) in every variable torch's import
    reads."""
    names = {
        n
        for n in (*env, *imported)
        if n.startswith(READ_AT_IMPORT)
        and n not in READ_LATER
        and not n.startswith(READ_LATER_PREFIXES)
    }
    return all(env.get(n) == imported.get(n) for n in names)


SERVER = r"""
import gc, json, os, selectors, signal, socket, struct, sys

# The imports every child would pay again: torch (2.3-3.3 CPU-s), torchvision (every image
# model; its ops import torch._dynamo: 1.5-2 CPU-s more), Hydra (every train.py: 0.3)
import torch, torchvision, hydra  # noqa: E401, F401

gc.freeze()  # their objects stay in the parent's pages: a child's collections never walk them


def receive(conn):  # a request: its length (4 bytes), its JSON, the child's 3 streams
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            raise EOFError("the test closed its request")
        data, fds = data + chunk, fds + more
    return data[4:].decode(), fds


def serve(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(0, selectors.EVENT_READ)  # the test process's pipe: closed when it ends
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = receive(conn)
                except (OSError, EOFError, struct.error):  # a test that went away mid-request
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child: leave the server's loop and become the command
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    selector.close()
                    for own in (listener, conn, *waiting.values()):
                        own.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    return request, fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"%d\n" % pid)
                waiting[pid] = conn
            elif key.fileobj == 0:
                os._exit(0)  # the test process has gone: so does its server
            else:
                os.read(wake_read, 4096)
                while waiting:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    conn = waiting.pop(pid, None)
                    if conn is None:
                        continue
                    try:
                        conn.sendall(b"%d\n" % status)
                    except OSError:  # the test stopped listening: nothing to tell
                        pass
                    conn.close()


def become(request, fds):  # the child: the command's streams, folder, environment, arguments
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    request = json.loads(request)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["new_session"]:
        os.setsid()
    sys.argv = request["argv"]
    first = os.getcwd() if request["module"] else os.path.dirname(os.path.abspath(sys.argv[0]))
    sys.path[0:1] = [first, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return request["module"]


_module = become(*serve(sys.argv[1]))
del become, serve, receive
import runpy

if _module:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:  # as the interpreter runs a script: __file__ absolute (a script that starts itself again
    # from another folder names it so), sys.argv[0] as typed (runpy.run_path sets both alike)
    import importlib.machinery, types

    _path = os.path.abspath(sys.argv[0])
    with open(_path, "rb") as _file:
        _code = compile(_file.read(), _path, "exec")
    _main = types.ModuleType("__main__")
    _main.__file__, _main.__cached__ = _path, None
    _main.__loader__ = importlib.machinery.SourceFileLoader("__main__", _path)
    sys.modules["__main__"] = _main
    exec(_code, _main.__dict__)
"""


HERE = os.path.dirname(os.path.abspath(__file__))
# The shim's interpreter starts isolated and without site-packages (-IS): 15 ms, no imports.
SHIM = """#!{python} -IS
import sys
sys.path.insert(0, {here!r})
from preloaded_python import shim
shim({config!r})
"""


class PreloadedPopen(subprocess.Popen):
    """A child of the preloaded Python as subprocess.Popen: poll, wait, communicate,
    send_signal, kill, terminate, its pipes. Its exit status comes from the server (its
    parent), over the connection the command was sent on."""

    def __init__(self, args, pid: int, conn, said: bytes, stdin, stdout, stderr, text: bool):
        # Popen.__init__ would fork and exec: the attributes its other methods read, set here
        self.args, self.pid, self.returncode = args, pid, None
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.encoding = self.errors = None
        self.text_mode = self.universal_newlines = text
        self.pipesize = -1
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = False  # nothing for Popen.__del__ to reap: the server does
        self._conn, self._said = conn, said  # `said`: what came after the pid, if anything

    def _try_wait(self, wait_flags):
        self._conn.setblocking(not (wait_flags & os.WNOHANG))
        while not self._said.endswith(b"\n"):
            try:
                chunk = self._conn.recv(64)
            except BlockingIOError:
                return 0, 0
            if not chunk:
                raise ChildProcessError(f"the preloaded Python died before child {self.pid}")
            self._said += chunk
        self._conn.close()
        return self.pid, int(self._said)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


class PreloadedPython:
    """One server per pytest worker, started at its first command, stopped at exit."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="kiln-preloaded-")
        self.path = os.path.join(self.folder, "server.sock")
        if len(self.path) > 100:  # a socket's path holds 107 bytes: a long TMPDIR's is too long
            os.rmdir(self.folder)
            self.folder = tempfile.mkdtemp(prefix="kiln-preloaded-", dir="/tmp")
            self.path = os.path.join(self.folder, "server.sock")
        self.log = open(os.path.join(self.folder, "server.log"), "w+")  # noqa: SIM115
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.path],
            env=self.env,
            stdin=subprocess.PIPE,  # its end of life: when this process closes it, or ends
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        atexit.register(self.stop)
        started = self.server.stdout.readline().strip() == "ready"
        # Imports that print something (a warning) would print it in each fresh interpreter:
        # then none of its commands comes from here, each says it as a user would see it. A
        # server that did not start is said once, and every command is a fresh interpreter.
        self.log.seek(0)
        self.said = self.log.read() if started else f"did not start: {self.log.read()}"
        if not started:
            warnings.warn(f"the preloaded Python {self.said}", stacklevel=2)
            return
        imported = {n: v for n, v in self.env.items() if n.startswith(READ_AT_IMPORT)}
        config = os.path.join(self.folder, "shim.json")
        with open(config, "w") as out:
            json.dump({"python": sys.executable, "socket": self.path, "env": imported}, out)
        os.mkdir(os.path.join(self.folder, "bin"))
        for name in ("python", "python3"):
            with open(os.path.join(self.folder, "bin", name), "w") as out:
                out.write(SHIM.format(python=sys.executable, here=HERE, config=config))
            os.chmod(out.name, 0o755)

    def stop(self) -> None:
        self.server.stdin.close()
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.server.stdout.close()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def imported_with(self, env: dict) -> bool:
        """Whether `env` agrees with the server's in every variable torch's import reads (and
        the server's imports printed nothing)."""
        return not self.said and imported_alike(env, self.env)

    def popen(
        self, argv, cwd, env, *, stdin, stdout, stderr, new_session=False, text=True
    ) -> PreloadedPopen:
        """`python *argv` (a script or `-m module`, its arguments) as this server's child; the
        streams as subprocess.Popen takes them (PIPE, DEVNULL, STDOUT, None, a file or fd)."""
        args = [sys.executable, *map(str, argv)]
        env = self.for_ranks(env)
        own, parent = [], []  # (the child's end, the test's end) of each of its three streams
        for number, stream in enumerate((stdin, stdout, stderr)):
            if stream == subprocess.PIPE:
                read, write = os.pipe()
                own.append(read if number == 0 else write)
                parent.append(write if number == 0 else read)
            elif stream == subprocess.DEVNULL or (stream is None and number == 0):
                own.append(os.open(os.devnull, os.O_RDWR))
                parent.append(None)
            elif stream == subprocess.STDOUT and number == 2:
                own.append(os.dup(own[1]))
                parent.append(None)
            else:  # None (this process's own stream), a file or a descriptor
                fd = stream if isinstance(stream, int) else number
                fd = stream.fileno() if hasattr(stream, "fileno") else fd
                own.append(os.dup(fd))
                parent.append(None)
        try:
            conn, pid, rest = send(self.path, args, cwd, env, own, new_session)
        except BaseException:
            for fd in parent:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in own:
                os.close(fd)
        ends = [None if fd is None else stream_end(fd, n == 0, text) for n, fd in enumerate(parent)]
        return PreloadedPopen(args, pid, conn, rest, *ends, text)

    def for_ranks(self, env: dict) -> dict:
        """`env` with this server's `python` as the interpreter torchrun starts its ranks
        with (PYTHON_EXEC; by default its own sys.executable, a fresh interpreter per rank),
        unless the caller named one."""
        if self.said or "PYTHON_EXEC" in env:
            return env
        return {**env, "PYTHON_EXEC": os.path.join(self.folder, "bin", "python")}

    def shell_path(self, env: dict) -> str:
        """`env`'s PATH with this server's `python` first (`shim`): a shell's `python
        train.py ...` (a command run as typed) goes through it as `python_process` does."""
        if self.said:
            return env["PATH"]
        return os.pathsep.join([os.path.join(self.folder, "bin"), env["PATH"]])


def unbuffered_alike(args: list[str], env) -> list[str]:
    """`python -u ...` as `python ...` where PYTHONUNBUFFERED is set, which does the same
    (torchrun starts its ranks with -u); else as given."""
    if len(args) > 1 and args[1] == "-u" and env.get("PYTHONUNBUFFERED"):
        return [args[0], *args[2:]]
    return args


def takes(args: list[str]) -> bool:
    """Whether `python *args[1:]` runs a script or a module (what a child can become)."""
    script = len(args) > 1 and args[1].endswith(".py") and not args[1].startswith("-")
    return script or (len(args) > 2 and args[1] == "-m")


def send(path: str, args: list[str], cwd, env: dict, fds: list[int], new_session: bool):
    """Asks the server at `path` for a child running `args` with `fds` as its stdin, stdout and
    stderr; returns the connection its exit status will come on, its pid, and what followed."""
    module = args[1] == "-m"
    request = {"argv": args[2:] if module else args[1:], "module": module}
    request |= {"cwd": str(cwd or os.getcwd()), "env": env, "new_session": new_session}
    request = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], fds)
    said = b""
    while b"\n" not in said:  # its pid (its exit status may follow)
        chunk = conn.recv(64)
        if not chunk:
            raise ChildProcessError("the preloaded Python died before forking")
        said += chunk
    pid, _, rest = said.partition(b"\n")
    return conn, int(pid), rest


def shim(config_file: str) -> None:
    """`python` on a shell's PATH (`PreloadedPython.shell_path`): a script or module through
    the server, with this process's own streams, folder and environment, its signals passed on
    and its exit status as the child's; anything else (or another environment for torch's
    import) is the real interpreter, exec'd in its place."""
    with open(config_file) as file:
        config = json.load(file)
    args = unbuffered_alike([config["python"], *sys.argv[1:]], os.environ)
    if not (takes(args) and imported_alike(dict(os.environ), config["env"])):
        os.execv(args[0], args)
    conn, pid, said = send(config["socket"], args, None, dict(os.environ), [0, 1, 2], False)
    for passed in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(passed, lambda number, _: os.kill(pid, number))
    while not said.endswith(b"\n"):
        said += conn.recv(64) or b"-1\n"  # -1: the server died, the child with it
    status = int(said)
    if status >= 0 and os.WIFSIGNALED(status):  # as the child ended: by the same signal
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status) if status >= 0 else 1)


def stream_end(fd: int, writes: bool, text: bool):
    """The test's end of a pipe, as subprocess.Popen opens it."""
    end = open(fd, "wb" if writes else "rb", -1)  # noqa: SIM115 -- the caller's to close
    if not text:
        return end
    return io.TextIOWrapper(end, write_through=True) if writes else io.TextIOWrapper(end)


_SERVERS: dict[int, PreloadedPython] = {}


def server(env: dict) -> PreloadedPython:
    """This process's preloaded Python (started with `env` at its first use)."""
    if os.getpid() not in _SERVERS:
        _SERVERS[os.getpid()] = PreloadedPython(env)
    return _SERVERS[os.getpid()]
