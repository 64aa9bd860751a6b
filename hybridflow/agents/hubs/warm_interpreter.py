"""A warm Python interpreter for programs a hub starts once per episode (verifiers' chat program).

verifiers' `null` and `bash` harnesses run their chat program as a fresh `python <script>` per episode
(and per turn of a multi-turn episode); importing what it imports (openai, httpx, mcp, pydantic) takes
1.5-2 s of a 2-core CPU each time, against milliseconds of the model's. `WarmInterpreter` starts one
server process that imports those modules once and forks a child per program; the "interpreter" it
hands to the hub is a launcher script (`launcher_path`) that runs under `python -S` (the standard
library only: ~20 ms), passes its argv, environment, working directory and standard streams to the
server over a Unix socket, and exits with the program's exit status. What the program sees is what
a fresh interpreter gives it: its own argv, environment, directory, streams and `__main__`.

Why not multiprocessing's forkserver: it forks workers for the parent's own functions, with the
parent's pipes; the hub starts the program itself (`asyncio.create_subprocess_exec`, its own pipes
and process group) and must keep doing so, so the fork has to happen behind an executable.

Lifetimes: a launcher killed (the hub's timeout kills its process group) closes its connection, and
the server's handler kills the program's whole process group; the server exits when the process
that started it is gone or `close` is called. A launcher that cannot reach the server (not started
yet, gone) runs the program in a cold interpreter instead: slower, never different.
"""

from __future__ import annotations

import ast
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STREAMS = (0, 1, 2)
HEADER = struct.Struct("!I")  # a request's length in bytes, then its JSON
STATUS = struct.Struct("!i")  # the program's exit status: a code, or -signal
POLL_S = 0.02  # how often a handler looks at its program and its launcher

LAUNCHER = '''import json, os, signal, socket, struct, sys, time
request = json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
deadline = time.monotonic() + %(wait_s)r
while True:
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(%(socket)r)
        socket.send_fds(connection, [struct.pack("!I", len(request)) + request], [0, 1, 2])
        break
    except OSError:
        connection.close()
    try:  # a server still importing (its pid file written, the process alive): wait for it, up to wait_s
        os.kill(int(open(%(pid_file)r).read()), 0)
        starting = time.monotonic() < deadline
    except (OSError, ValueError):
        starting = False
    if not starting:  # no server (never started, or gone): the program in a cold interpreter
        os.execv(%(python)r, [%(python)r, *sys.argv[1:]])
    time.sleep(0.05)
status = b""
while len(status) < 4:
    chunk = connection.recv(4 - len(status))
    if not chunk:
        sys.exit(%(lost)d)
    status += chunk
code = struct.unpack("!i", status)[0]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''
LOST_EXIT_CODE = 70  # the server died with the program unfinished (EX_SOFTWARE)
STARTING_WAIT_S = 60.0  # how long a launcher waits for a server that is still importing, before running cold


def imported_modules(source: str) -> list[str]:
    """The top-level modules `source` imports, anywhere in it (a program's lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return sorted(names)


class WarmInterpreter:
    """One server process with `modules` imported (`start`); `launcher_path` runs a program forked from it.
    Until `start`, and once the server is gone, a launcher runs its program cold; while the server is
    still importing, a launcher waits for it (up to STARTING_WAIT_S), since a cold start would compete
    with those same imports for the CPU."""

    def __init__(self, modules: list[str], warmup: str = "", starting_wait_s: float = STARTING_WAIT_S) -> None:
        """`warmup`: code the server runs after the imports, for what a module imports lazily (a client's
        first attribute access); it must start no thread. `starting_wait_s`: how long a launcher waits for
        a server still importing before it runs its program cold."""
        self.modules = list(modules)
        self.directory = Path(tempfile.mkdtemp(prefix="hybridflow-warm-"))
        self.warmup_path = self.directory / "warmup.py"
        self.warmup_path.write_text(warmup)
        self.socket_path = self.directory / "server.sock"
        self.pid_path = self.directory / "server.pid"
        self.launcher_path = self.directory / "python"
        self.launcher_path.write_text(f"#!{sys.executable} -S\n" + LAUNCHER % {
            "socket": str(self.socket_path), "python": sys.executable, "lost": LOST_EXIT_CODE,
            "pid_file": str(self.pid_path), "wait_s": starting_wait_s})
        self.launcher_path.chmod(0o755)
        self.log_path = self.directory / "server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (once): it imports the modules, then listens."""
        if self.process is not None:
            return
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(self.socket_path),  # run as a file: no hybridflow imports
                 str(os.getpid()), str(self.warmup_path), *self.modules], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.pid_path.write_text(str(self.process.pid))

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """True once the server listens; False if it exited or `timeout_s` passed (launchers then run cold)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.socket_path.exists():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.pid_path.unlink(missing_ok=True)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for path in (self.socket_path, self.launcher_path, self.log_path, self.warmup_path,
                     Path(str(self.socket_path) + ".bind")):
            path.unlink(missing_ok=True)
        self.directory.rmdir()


# ---- the server (python .../warm_interpreter.py SOCKET PARENT_PID MODULE...: this file, the standard library) --
def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, len(STREAMS))
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        more = connection.recv(1 << 20)
        if not more:
            raise ConnectionError("the launcher closed its connection mid-request")
        data += more
    return json.loads(data[HEADER.size:HEADER.size + HEADER.unpack_from(data)[0]]), fds


def _run_program(request: dict, fds: list[int]) -> None:
    """In the forked child: become the program (its streams, directory, environment, argv), run it, exit."""
    os.setpgid(0, 0)  # its own process group: the handler ends the whole tree when the launcher is gone
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    if "numpy" in sys.modules:  # a fresh interpreter's unseeded draws (`random` reseeds itself at a fork)
        sys.modules["numpy"].random.seed()
    for target, fd in zip(STREAMS, fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd not in STREAMS:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = list(argv)
    # the path a fresh `python script` would search first: the script's folder, then the request's PYTHONPATH
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
    code = 0
    try:
        import runpy

        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a program's uncaught error: its traceback, exit 1, as python does
        import traceback

        traceback.print_exc()
        code = 1
    _interpreter_exit()
    os._exit(code)


def _interpreter_exit() -> None:
    """What a fresh interpreter does as it exits: wait for the program's non-daemon threads, run its
    atexit handlers (a Ray worker tells its node it is leaving in one: without it the node reports the
    exit as a crash), flush its streams. Then the child ends with os._exit: nothing of the server's own runs."""
    import atexit
    import threading

    try:
        threading._shutdown()
    except Exception:  # noqa: BLE001 - as at an interpreter's exit: the handlers still run
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass


def _handle(connection: socket.socket) -> None:
    """In a forked handler: fork the program, report its exit status; end it if the launcher goes."""
    request, fds = _receive(connection)
    program = os.fork()
    if program == 0:
        connection.close()
        _run_program(request, fds)
    for fd in fds:
        os.close(fd)
    while True:
        pid, status = os.waitpid(program, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(status)
            try:
                connection.sendall(STATUS.pack(code))
            except OSError:
                pass
            os._exit(0)
        readable, _, _ = select.select([connection], [], [], POLL_S)
        if readable and not connection.recv(1):  # the launcher is gone (killed): so is its program
            try:
                os.killpg(program, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(program, 0)
            os._exit(0)


def serve(socket_path: str, parent_pid: int, warmup_path: str, modules: list[str]) -> None:
    for module in modules:
        try:
            __import__(module)
        except Exception as error:  # noqa: BLE001 - a module that fails here fails in the program, named there
            print(f"warm interpreter: import {module} failed ({error}); the program imports it itself", flush=True)
    try:
        exec(compile(Path(warmup_path).read_text(), warmup_path, "exec"), {"__name__": "__warmup__"})
    except Exception as error:  # noqa: BLE001 - the program then does that work itself
        print(f"warm interpreter: the warm-up failed ({error})", flush=True)
    import threading

    if threading.active_count() > 1:  # forking a process with threads could copy a held lock
        print(f"warm interpreter: {threading.active_count()} threads after the imports; serving nothing, "
              "launchers run cold", flush=True)
        Path(socket_path).with_name("server.pid").unlink(missing_ok=True)
        return
    import gc

    gc.collect()
    gc.freeze()  # the imports' objects out of every child's collections: a collection there would write to each
    # object's header, copying every page the child shares with this server (seconds for torch and vLLM's)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = socket_path + ".bind"
    listener.bind(partial)
    listener.listen(64)
    os.rename(partial, socket_path)  # launchers see the path only once it accepts
    listener.settimeout(1.0)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while os.getppid() == parent_pid and not stopping:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap finished handlers
                pass
        except ChildProcessError:
            pass
        try:
            connection, _ = listener.accept()
        except (TimeoutError, InterruptedError):
            continue
        sys.stdout.flush()
        if os.fork() == 0:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                listener.close()
                connection.settimeout(None)
                _handle(connection)
            finally:
                os._exit(0)  # a handler never returns into the server's loop
        connection.close()
    listener.close()
    Path(socket_path).unlink(missing_ok=True)
    Path(socket_path).with_name("server.pid").unlink(missing_ok=True)  # launchers stop waiting: they run cold


if __name__ == "__main__":
    del sys.path[0]  # this file's folder (hybridflow/agents/hubs): its modules are no program's imports
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
