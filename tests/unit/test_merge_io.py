"""Streaming safetensors reads and writes against the safetensors library."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridflow.merge.errors import MergeError
from hybridflow.merge.safetensors_io import OutputTensor, ShardedWriter, plan_shards, read_header, read_tensor


def sample_tensors():
    torch.manual_seed(0)
    return {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2).to(torch.float16),
        "i64": torch.arange(6).reshape(2, 3),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def test_read_matches_safetensors(tmp_path):
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    entries, metadata = read_header(tmp_path / "a.safetensors")
    assert metadata == {"format": "pt"} and set(entries) == set(tensors)
    for key, tensor in tensors.items():
        assert torch.equal(read_tensor(entries[key]), tensor), key


def write(tmp_path, tensors, max_shard_bytes, metadata):
    planned = [OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    writer = ShardedWriter(tmp_path, planned, max_shard_bytes, {"format": "pt", "note": "x" * 10})
    for key, tensor in tensors.items():
        writer.write(key, tensor)
    return writer.finish(metadata)


def test_writer_round_trip_one_file(tmp_path):
    tensors = sample_tensors()
    files = write(tmp_path, tensors, 10**9, {"format": "pt", "note": "final"})
    assert [f.name for f in files] == ["model.safetensors"]
    loaded = load_file(files[0])
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
    with safe_open(files[0], "pt") as handle:  # the rewritten header is read by the library
        assert handle.metadata() == {"format": "pt", "note": "final"}
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_writer_shards_with_index(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    files = write(tmp_path, tensors, 100, {"format": "pt"})
    # 100-byte cap: two tensors per shard -> 3 shards
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200
    assert index["weight_map"] == {"t0": files[0].name, "t1": files[0].name, "t2": files[1].name,
                                   "t3": files[1].name, "t4": files[2].name}
    for key, tensor in tensors.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][key])[key], tensor)


def test_plan_shards_gives_big_tensor_its_own_shard():
    sizes = [OutputTensor(n, torch.float32, (s,)) for n, s in (("a", 5), ("b", 100), ("c", 5))]
    assert [[t.name for t in shard] for shard in plan_shards(sizes, 40)] == [["a"], ["b"], ["c"]]


def test_writer_refuses_out_of_plan_tensor(tmp_path):
    writer = ShardedWriter(tmp_path, [OutputTensor("a", torch.float32, (2,))], 100, {})
    with pytest.raises(RuntimeError, match="expected"):
        writer.write("a", torch.zeros(3))
    writer.close()


def test_truncated_file_names_the_file(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.randn(100)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(MergeError, match=r"cut.safetensors.*truncated"):
        read_header(path)


@pytest.mark.parametrize("content, message", [
    (b"abc", "too short"),
    ((10**6).to_bytes(8, "little") + b"{}", "truncated or not a safetensors file"),
    ((4).to_bytes(8, "little") + b"{{{{", "not valid JSON"),
    ((2).to_bytes(8, "little") + b"{}" + b"junk", "unexpected bytes"),
])
def test_corrupt_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(MergeError, match=message):
        read_header(path)


def test_wrong_byte_count_in_header(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    with pytest.raises(MergeError, match="needs 16 bytes"):
        read_header(path)


def test_input_hasher_fed_in_order_out_of_order_or_not_at_all(tmp_path):
    import hashlib

    from hybridflow.merge.provenance import InputHasher

    save_file({f"t{i}": torch.randn(1000) for i in range(4)}, tmp_path / "a.safetensors")
    save_file({"x": torch.randn(10)}, tmp_path / "b.safetensors")
    entries, _ = read_header(tmp_path / "a.safetensors")
    ordered = sorted(entries.values(), key=lambda e: e.offset)
    hasher = InputHasher([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    # t2 skips t1 (the hasher reads t1 from the file); then t1 and t0 are re-reads: ignored
    for entry in (ordered[0], ordered[2], ordered[1], ordered[0]):
        hasher.feed(entry.file, entry.offset, read_tensor(entry).reshape(-1).view(torch.uint8))
    digests = hasher.result()  # the rest of a.safetensors and all of b.safetensors are read here
    for name in ("a.safetensors", "b.safetensors"):
        assert digests[tmp_path / name] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
