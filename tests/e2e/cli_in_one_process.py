"""Run the `hybridflow` command's code (hybridflow.cli.run_command: `main` less its end of the process)
once per argument list, in this one process,
and print each run's exit status, output, seconds and whether Ray was started, as JSON.

    python -m tests.e2e.cli_in_one_process '{"case": ["recipe=grpo", ...], ...}'

For tests of commands refused before anything starts: each is the command's own code path (Hydra's
composition, the config checks, the input checks, the exit status), without paying a fresh
interpreter's imports per command (3-4 s each on 2 cores, 0.2-0.4 s here)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time


def main() -> None:
    from hybridflow import cli

    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.argv = ["hybridflow", *argv]
        start = time.perf_counter()
        code = 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.run_command()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        ray = sys.modules.get("ray")
        results[name] = {"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                         "seconds": time.perf_counter() - start,
                         "ray_started": bool(ray is not None and ray.is_initialized())}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
