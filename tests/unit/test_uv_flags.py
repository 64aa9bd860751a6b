"""scripts/uv_flags.py: pip's configuration as uv's flags, so setup.sh's uv installs from where pip would."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
uv_flags = runpy.run_path(str(ROOT / "scripts" / "uv_flags.py"))["uv_flags"]


def test_each_key_becomes_uvs_flag_one_value_each():
    listing = ("global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'\n"
               "global.find-links='/opt/wheels'\n"
               "global.constraint='/etc/xdg/pip/constraints.txt'\n"
               "global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
               "global.timeout='60'\n")
    assert uv_flags(listing) == ["--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url",
                                 "file:///opt/pypi-more/simple", "--find-links", "/opt/wheels",
                                 "--constraint", "/etc/xdg/pip/constraints.txt",
                                 "--cert", "/etc/ssl/certs/ca-certificates.crt"]


def test_the_environment_wins_over_the_install_section_over_global_whatever_the_order():
    listing = (":env:.index-url='https://env.example/simple'\n"
               "global.index-url='https://global.example/simple'\n"
               "global.find-links='/global'\n"
               "install.find-links='/install'\n")
    assert uv_flags(listing) == ["--index-url", "https://env.example/simple", "--find-links", "/install"]


def test_no_configuration_gives_no_flags_and_the_script_prints_them_one_per_line():
    assert uv_flags("") == []
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "uv_flags.py")], input="global.find-links='/a /b'\n",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split("\n") == ["--find-links", "/a", "--find-links", "/b", ""]
