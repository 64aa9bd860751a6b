"""What one node's storage probe reports, and where a shipped code file is found (no Ray)."""

from __future__ import annotations

import sys

from hybridflow.controller.storage import CODE_PACKAGE, TOKEN_FILE, probe, shipped_copy, stage_code_files


def test_a_node_that_reads_and_writes_everything_reports_nothing(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    (tmp_path / TOKEN_FILE).write_text("abc")
    code = tmp_path / "reward.py"
    code.write_text("def score(**_): return 1.0\n")
    assert probe({"model.path": str(tmp_path / "model"), "data.train_path": str(tmp_path / "train.parquet")},
                  {"reward.fn": str(code)}, str(tmp_path), "abc") == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hybridflow-probe")]  # the probe file is gone


def test_each_missing_input_and_a_foreign_run_directory_are_named(tmp_path):
    (tmp_path / TOKEN_FILE).write_text("another run's token")
    problems = probe({"data.val_path": str(tmp_path / "val.parquet")}, {"reward.fn": str(tmp_path / "gone.py")},
                     str(tmp_path), "abc")
    assert problems == [
        f"data.val_path={tmp_path / 'val.parquet'}: no such file or directory",
        f"reward.fn={tmp_path / 'gone.py'}: not on this node's disk and not in the job's shipped code",
        f"run directory {tmp_path}: exists here but is not the driver's (the token the driver wrote there is "
        "missing): a local directory at the same path, not shared storage",
    ]
    assert "no such directory" in probe({}, {}, str(tmp_path / "elsewhere"), None)[0]


def test_a_shipped_code_file_is_found_when_its_own_path_is_missing(tmp_path, monkeypatch):
    original = tmp_path / "src" / "reward.py"
    original.parent.mkdir()
    original.write_text("def score(**_): return 1.0\n")
    package = stage_code_files([str(original)], tmp_path / "staging")
    assert package.name == CODE_PACKAGE
    original.unlink()
    assert shipped_copy(original) is None  # the package is not importable yet
    monkeypatch.syspath_prepend(str(package.parent))  # what Ray's py_modules does on a node
    sys.modules.pop(CODE_PACKAGE, None)
    copy = shipped_copy(original)
    assert copy is not None and copy.read_text().startswith("def score")
    assert probe({}, {"reward.fn": str(original)}, None, None) == []
    sys.modules.pop(CODE_PACKAGE, None)
