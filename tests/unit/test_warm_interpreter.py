"""The warm interpreter (hybridflow/agents/hubs/warm_interpreter.py) as a hub uses it: its launcher started
as `launcher script args` with the hub's own pipes, environment, directory and process group, the program
forked from the server seeing what a fresh `python script args` would, and its exit status, a signal that
ended it, a launcher killed mid-program and a server that is gone each ending as they would there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hybridflow.agents.hubs.warm_interpreter import WarmInterpreter, imported_modules

PROGRAM = '''import json, os, sys
import email.mime.text  # imported by the server before the fork: already in sys.modules here
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "var": os.environ.get("WARM_TEST"),
                  "stdin": sys.stdin.read(), "path0": sys.path[0], "warm": os.environ.get("WARM_EXPECT")}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


@pytest.fixture
def warm(tmp_path):
    interpreter = WarmInterpreter(["json", "email.mime.text"])
    assert interpreter.wait_ready(), interpreter.log_path.read_text()
    yield interpreter
    interpreter.close()


def _run(launcher, script, *args, cwd, stdin="", env=None, timeout=30):
    return subprocess.run([str(launcher), str(script), *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout, start_new_session=True)


def test_the_program_sees_its_own_argv_streams_directory_and_environment_and_exits_with_its_code(warm, tmp_path):
    import json

    script = tmp_path / "prog" / "program.py"
    script.parent.mkdir()
    script.write_text(PROGRAM)
    done = _run(warm.launcher_path, script, "3", "--flag=x", cwd=tmp_path, stdin="hello", env={"WARM_TEST": "v"})
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": [str(script), "3", "--flag=x"], "cwd": str(tmp_path), "name": "__main__", "var": "v",
                    "stdin": "hello", "path0": str(script.parent), "warm": None}
    assert done.stderr == "to stderr\n"
    cold = subprocess.run([sys.executable, str(script), "3", "--flag=x"], input="hello", capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "WARM_TEST": "v"})
    assert (cold.returncode, json.loads(cold.stdout), cold.stderr) == (done.returncode, seen, done.stderr)


def test_an_uncaught_error_and_a_signal_end_the_launcher_as_they_end_python(warm, tmp_path):
    failing = tmp_path / "failing.py"
    failing.write_text("raise ValueError('planted')\n")
    done = _run(warm.launcher_path, failing, cwd=tmp_path)
    assert done.returncode == 1 and "ValueError: planted" in done.stderr
    killed = tmp_path / "killed.py"
    killed.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert _run(warm.launcher_path, killed, cwd=tmp_path).returncode == -signal.SIGTERM


def test_a_launcher_killed_mid_program_ends_the_program(warm, tmp_path):
    marker = tmp_path / "still_running"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(f"import time, pathlib\nfor _ in range(100):\n    pathlib.Path({str(marker)!r}).touch()\n"
                       "    time.sleep(0.1)\n")
    launcher = subprocess.Popen([str(warm.launcher_path), str(sleeper)], cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    os.killpg(launcher.pid, signal.SIGKILL)  # what verifiers' SubprocessRuntime does when an episode times out
    launcher.wait()
    time.sleep(0.5)
    marker.unlink()
    time.sleep(0.5)
    assert not marker.exists()  # the program no longer touches it


def test_without_a_server_the_launcher_runs_the_program_cold(tmp_path):
    import json

    interpreter = WarmInterpreter(["json"])
    assert interpreter.wait_ready()
    interpreter.process.terminate()
    interpreter.process.wait(timeout=10)
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    done = _run(interpreter.launcher_path, script, "0", cwd=tmp_path, env={"WARM_TEST": "cold"})
    assert done.returncode == 0 and json.loads(done.stdout)["var"] == "cold", done.stderr
    interpreter.close()


def test_a_launcher_runs_cold_before_start_and_waits_for_a_server_still_importing(tmp_path, monkeypatch):
    """Before `start` the program runs in a cold interpreter at once; started, a server whose imports take
    2 s (a module that sleeps) is waited for, and the program then runs warm, its module already imported."""
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    script = tmp_path / "which.py"
    script.write_text("import sys\nprint('warm' if 'slow_module' in sys.modules else 'cold')\n")
    interpreter = WarmInterpreter(["slow_module"])
    try:
        assert _run(interpreter.launcher_path, script, cwd=tmp_path).stdout == "cold\n"
        interpreter.start()
        assert _run(interpreter.launcher_path, script, cwd=tmp_path).stdout == "warm\n"
    finally:
        interpreter.close()


def test_the_warm_up_runs_once_in_the_server_before_any_program(tmp_path):
    """What a module imports lazily (openai's chat types on a client's first `.chat`) is done by the warm-up
    code in the server: each forked program finds its result, without running it again."""
    interpreter = WarmInterpreter(["email.mime.text"], warmup="import email.mime.text as m\nm.WARMED = 1\n")
    try:
        assert interpreter.wait_ready()
        script = tmp_path / "warmed.py"
        script.write_text("import email.mime.text as m\nprint(getattr(m, 'WARMED', 0))\n")
        assert _run(interpreter.launcher_path, script, cwd=tmp_path).stdout == "1\n"
    finally:
        interpreter.close()


def test_imported_modules_finds_lazy_imports_too():
    source = "import a.b, c\nfrom d.e import f\nfrom . import g\ndef h():\n    import i\n    from j import k\n"
    assert imported_modules(source) == ["a.b", "c", "d.e", "i", "j"]
