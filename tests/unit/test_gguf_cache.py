"""The converted GGUF model's cache (hybridflow/builders/gguf.py): reused for the same bytes, however
the file was installed; converted again when the bytes differ."""

from __future__ import annotations

import json
import os

import pytest

from hybridflow.builders.gguf import SOURCE_FILE, convert_gguf, source_record


def test_a_reinstalled_file_with_the_same_bytes_reuses_the_conversion_and_other_bytes_do_not(tmp_path):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / SOURCE_FILE).write_text(json.dumps(source_record(gguf_file, "float32")))
    assert convert_gguf(gguf_file, converted) == converted  # nothing read beyond the record

    stat = gguf_file.stat()  # a new virtual environment: the same bytes, a new modification time
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**12))
    assert convert_gguf(gguf_file, converted) == converted

    gguf_file.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))  # same size, other bytes
    assert gguf_file.stat().st_size == stat.st_size
    with pytest.raises(ValueError, match="GGUF"):  # not the cached directory: it reads the file, which is no model
        convert_gguf(gguf_file, converted)
    assert json.loads((converted / SOURCE_FILE).read_text()) != source_record(gguf_file, "float32")
