"""uv's flags for pip's own configuration: `pip config list | python scripts/uv_flags.py` prints
them one per line, for scripts/setup.sh, which installs with uv where it can.

pip's index, extra indexes, find-links and constraints (from its files and PIP_* variables) become
uv's `--index-url`, `--extra-index-url`, `--find-links` and `--constraint`; pip's certificate
becomes `--cert FILE`, which setup.sh hands to uv as SSL_CERT_FILE (uv has no such flag). A key
set in several places takes pip's precedence: the environment (":env:"), then the [install]
section, then [global].
"""

from __future__ import annotations

import shlex
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "cert": "--cert"}
SECTION_RANK = {":env:": 0, "install": 1, "global": 2}  # lower wins


def uv_flags(pip_config_list: str) -> list[str]:
    """`pip config list`'s lines (`section.key='value'`) as uv's flags, in FLAGS' order."""
    chosen: dict[str, tuple[int, str]] = {}
    for line in pip_config_list.splitlines():
        name, _, value = line.strip().partition("=")
        section, _, key = name.rpartition(".")
        if key not in FLAGS:
            continue
        rank = SECTION_RANK.get(section, len(SECTION_RANK))
        if rank <= chosen.get(key, (len(SECTION_RANK) + 1, ""))[0]:
            chosen[key] = (rank, " ".join(shlex.split(value)))
    flags = []
    for key, flag in FLAGS.items():
        for item in chosen.get(key, (0, ""))[1].split():
            flags += [flag, item]
    return flags


if __name__ == "__main__":
    print("\n".join(uv_flags(sys.stdin.read())))
