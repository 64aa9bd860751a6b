"""The `hybridflow` command's entry point with `import ray` failing, as on a machine without Ray
(tests/e2e/cli_in_one_process.py `without_ray` runs it, cold or forked warm: tests/warm_workers.py)."""

import sys

sys.path[0] = ""  # the working directory, as for `python -c`: not this folder, whose modules (workers.py) would shadow the project's
sys.modules["ray"] = None

from hybridflow.cli import main  # noqa: E402 - after Ray's import is blocked

sys.exit(main())
