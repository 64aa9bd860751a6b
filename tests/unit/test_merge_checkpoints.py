"""merge_checkpoints end to end: every method against a plain-torch reference on full state
dicts, the validation rules, atomic output, provenance, the run layout and the CLI."""

import hashlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.merge import MergeError, checkpoints, last_checkpoints, merge_checkpoints, merge_state_dicts
from hybridflow.merge import safetensors_io
from hybridflow.merge.cli import main
from hybridflow.merge.methods import tensor_seed

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
COPIED = ("model.rotary_emb.inv_freq", "model.step_count", "model.mask")


def tiny_state(seed, base=None):
    """A tiny model: tied embedding, a linear layer, a norm, a float buffer and int/bool tensors."""
    g = torch.Generator().manual_seed(seed)
    if base is None:
        sd = {EMBED: torch.randn(16, 8, generator=g), "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
              "model.layers.0.mlp.up_proj.bias": torch.randn(12, generator=g), "model.norm.weight": torch.randn(8, generator=g),
              "model.rotary_emb.inv_freq": torch.rand(4, generator=g)}
    else:  # a fine-tune of `base`: small random task vectors
        sd = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    sd[HEAD] = sd[EMBED].clone()
    sd["model.step_count"] = torch.tensor([seed, 2 * seed, 3])
    sd["model.mask"] = torch.rand(5, generator=g) > 0.5
    return sd


def save_dir(path, sd, step=None):
    path.mkdir(parents=True)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "torch_dtype": "float32", "step": step}))
    (path / "tokenizer.json").write_text(json.dumps({"seed": step}))
    (path / "generation_config.json").write_text("{}")
    return path


@pytest.fixture
def models(tmp_path):
    base = tiny_state(0)
    tuned = [tiny_state(s, base) for s in (1, 2, 3)]
    base_dir = save_dir(tmp_path / "base", base)
    dirs = [save_dir(tmp_path / f"step_{100 * (i + 1):08d}", sd, step=i) for i, sd in enumerate(tuned)]
    return base_dir, dirs, base, tuned


def load_dir(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# ------------------------------------------------------------------ plain-torch references


def ref_trim(tau, density):
    k = round(density * tau.numel())
    threshold = tau.abs().flatten().sort(descending=True).values[k - 1]
    return torch.where(tau.abs() >= threshold, tau, 0.0)


def ref_dare(tau, density, seed, name, index):
    keep = torch.rand(tau.shape, generator=torch.Generator().manual_seed(tensor_seed(seed, name, index))) < density
    return torch.where(keep, tau / density, 0.0)


def ref_disjoint(taus):
    stacked = torch.stack(taus)
    agree = (torch.sign(stacked) == torch.sign(stacked.sum(0))) & (stacked != 0)
    return (stacked * agree).sum(0) / agree.sum(0).clamp(min=1)


def ref_slerp(a, b, t):
    a64, b64 = a.double().flatten(), b.double().flatten()
    omega = math.acos(float(a64 @ b64 / (a64.norm() * b64.norm())))
    return ((math.sin((1 - t) * omega) * a64 + math.sin(t * omega) * b64) / math.sin(omega)).view(a.shape).float()


def ref_ema(ts, alpha):
    m = ts[0]
    for t in ts[1:]:
        m = alpha * t + (1 - alpha) * m
    return m


REFERENCE = {
    "sma": lambda ts, b, k, p: torch.stack(ts).mean(0),
    "ema": lambda ts, b, k, p: ref_ema(ts, p["alpha"]),
    "wma": lambda ts, b, k, p: sum((i + 1) * t for i, t in enumerate(ts)) / (len(ts) * (len(ts) + 1) / 2),
    "linear": lambda ts, b, k, p: sum(w * t for w, t in zip(p["weights"], ts)) / sum(p["weights"]),
    "task_arithmetic": lambda ts, b, k, p: b + p["lam"] * sum(t - b for t in ts),
    "ties": lambda ts, b, k, p: b + p["lam"] * ref_disjoint([ref_trim(t - b, p["density"]) for t in ts]),
    "dare_linear": lambda ts, b, k, p: b + sum(ref_dare(t - b, p["density"], p["seed"], k, i) for i, t in enumerate(ts)),
    "dare_ties": lambda ts, b, k, p: b + ref_disjoint([ref_dare(t - b, p["density"], 0, k, i) for i, t in enumerate(ts)]),
    "slerp": lambda ts, b, k, p: ref_slerp(ts[0], ts[1], p["t"]),
}


def reference(method, sds, base, params):
    out = {}
    for key, newest in sds[-1].items():
        if key in COPIED:
            out[key] = newest
        elif key != HEAD:
            out[key] = REFERENCE[method]([sd[key].float() for sd in sds], base[key].float() if base else None, key, params)
    out[HEAD] = out[EMBED]  # tied in every input: stays tied
    return out


CASES = [
    ("sma", {}, 3, False), ("ema", {"alpha": 0.3}, 3, False), ("wma", {}, 3, False),
    ("linear", {"weights": [1.0, 2.0, 3.0]}, 3, False), ("task_arithmetic", {"lam": 0.7}, 3, True),
    ("ties", {"density": 0.5, "lam": 1.2}, 3, True), ("dare_linear", {"density": 0.6, "seed": 3}, 3, True),
    ("dare_ties", {"density": 0.6}, 3, True), ("slerp", {"t": 0.3}, 2, False),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """Stream in 48-byte blocks so that every tiny tensor spans several blocks."""
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 48)
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 48)


@pytest.mark.parametrize("method, params, n, with_base", CASES)
def test_method_matches_reference(models, tmp_path, small_blocks, method, params, n, with_base):
    base_dir, dirs, base, tuned = models
    out = merge_checkpoints(dirs[-n:], tmp_path / "out", method, base=base_dir if with_base else None,
                            max_shard_bytes=600, **params)
    merged = load_dir(out)
    expected = reference(method, tuned[-n:], base if with_base else None, params)
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert merged[key].dtype == tuned[-1][key].dtype, key
        assert torch.allclose(merged[key], value, rtol=1e-5, atol=1e-6), key
    assert torch.equal(merged[HEAD], merged[EMBED])
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1  # 600-byte shards
    assert torch.equal(merged["model.rotary_emb.inv_freq"], tuned[-1]["model.rotary_emb.inv_freq"])
    record = json.loads((out / "merge_provenance.json").read_text())  # hashes fed by the merge's reads
    described = record["inputs"] + ([record["base"]] if with_base else [])
    for entry, path in zip(described, dirs[-n:] + ([base_dir] if with_base else [])):
        file = (path / "model.safetensors").resolve()
        assert entry["sha256"] == {str(file): hashlib.sha256(file.read_bytes()).hexdigest()}


def test_in_memory_merge_matches_streaming(models, tmp_path):
    base_dir, dirs, base, tuned = models
    on_disk = load_dir(merge_checkpoints(dirs, tmp_path / "out", "ties", base=base_dir, density=0.4))
    in_memory = merge_state_dicts(tuned, "ties", base=base, density=0.4)
    assert all(torch.equal(on_disk[k], in_memory[k]) for k in on_disk)
    assert in_memory[HEAD] is in_memory[EMBED]


def test_bf16_inputs_and_output_dtypes(tmp_path, small_blocks):
    sds = [{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tiny_state(s).items()} for s in (1, 2)]
    dirs = [save_dir(tmp_path / f"c{i}", sd) for i, sd in enumerate(sds)]
    expected = (sds[0][EMBED].float() + sds[1][EMBED].float()) / 2
    as_fp32 = load_dir(merge_checkpoints(dirs, tmp_path / "f32", "sma", dtype="float32"))
    assert as_fp32[EMBED].dtype == torch.float32 and torch.allclose(as_fp32[EMBED], expected)
    as_bf16 = load_dir(merge_checkpoints(dirs, tmp_path / "bf16", "sma"))
    assert as_bf16[EMBED].dtype == torch.bfloat16 and torch.equal(as_bf16[EMBED], expected.to(torch.bfloat16))
    assert as_bf16["model.step_count"].dtype == torch.int64
    merge_checkpoints(dirs, tmp_path / "f16", "sma", dtype="float16")
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"


def test_untied_lm_head_is_merged_on_its_own(tmp_path):
    sds = [tiny_state(s) for s in (1, 2)]
    sds[0][HEAD] = sds[0][HEAD] + 1.0  # not equal to the embedding in every input
    dirs = [save_dir(tmp_path / f"c{i}", sd) for i, sd in enumerate(sds)]
    merged = load_dir(merge_checkpoints(dirs, tmp_path / "out", "sma"))
    assert torch.allclose(merged[HEAD], (sds[0][HEAD] + sds[1][HEAD]) / 2)


def test_absent_lm_head_is_not_invented(tmp_path):
    sds = [{k: v for k, v in tiny_state(s).items() if k != HEAD} for s in (1, 2)]
    dirs = [save_dir(tmp_path / f"c{i}", sd) for i, sd in enumerate(sds)]
    assert HEAD not in load_dir(merge_checkpoints(dirs, tmp_path / "out", "sma"))


def test_extra_files_and_provenance(models, tmp_path):
    _, dirs, _, _ = models
    out = merge_checkpoints(dirs, tmp_path / "out", "ema", alpha=0.5)
    assert json.loads((out / "tokenizer.json").read_text()) == {"seed": 2}  # from the newest input
    assert (out / "generation_config.json").exists() and (out / "config.json").exists()
    record = json.loads((out / "merge_provenance.json").read_text())
    assert record["method"] == "ema" and record["params"]["alpha"] == 0.5
    assert record["effective_weights"] == pytest.approx([0.25, 0.25, 0.5])
    assert [i["step"] for i in record["inputs"]] == [100, 200, 300]
    for entry, path in zip(record["inputs"], dirs):
        file = path / "model.safetensors"
        assert entry["sha256"] == {str(file.resolve()): hashlib.sha256(file.read_bytes()).hexdigest()}
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as handle:
        assert json.loads(handle.metadata()["hybridflow_merge"]) == record


def test_custom_method_from_a_file(models, tmp_path):
    _, dirs, _, tuned = models
    (tmp_path / "my_merge.py").write_text(
        "import torch\n"
        "def median(tensors, *, base, params, name):\n"
        "    return torch.stack(tensors).median(dim=0).values\n")
    merged = load_dir(merge_checkpoints(dirs, tmp_path / "out", f"{tmp_path / 'my_merge.py'}:median"))
    expected = torch.stack([sd["model.norm.weight"] for sd in tuned]).median(dim=0).values
    assert torch.equal(merged["model.norm.weight"], expected)
    assert torch.equal(merged["model.step_count"], tuned[-1]["model.step_count"])  # still copied


# ------------------------------------------------------------------------ validation


def assert_nothing_written(tmp_path):
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]
    assert leftovers == [], leftovers


def test_missing_key_is_refused_and_nothing_written(models, tmp_path):
    _, dirs, _, tuned = models
    broken = save_dir(tmp_path / "broken", {k: v for k, v in tuned[0].items() if k != "model.norm.weight"})
    with pytest.raises(MergeError, match=r"broken: missing key 'model.norm.weight'"):
        merge_checkpoints([broken, dirs[1]], tmp_path / "out", "sma")
    assert_nothing_written(tmp_path)


def test_wrong_shape_and_dtype_are_listed(models, tmp_path):
    _, dirs, _, tuned = models
    sd = dict(tuned[0], **{"model.norm.weight": torch.zeros(9), EMBED: tuned[0][EMBED].double()})
    broken = save_dir(tmp_path / "broken", sd)
    with pytest.raises(MergeError, match=r"(?s)2 problems.*'model.embed_tokens.weight' has dtype torch.float64.*"
                                         r"'model.norm.weight' has shape \[9\].*has \[8\]"):
        merge_checkpoints([broken, dirs[1]], tmp_path / "out", "sma")
    assert_nothing_written(tmp_path)


def test_truncated_input_is_refused_and_nothing_written(models, tmp_path):
    _, dirs, _, _ = models
    file = dirs[0] / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-7])
    with pytest.raises(MergeError, match=rf"{file}.*truncated"):
        merge_checkpoints(dirs, tmp_path / "out", "sma")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("method, params", [("sma", {}), ("ties", {"density": 0.5})])
def test_nan_input_is_refused_naming_file_and_key(models, tmp_path, method, params):
    base_dir, dirs, _, tuned = models
    sd = dict(tuned[0])
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][3] = float("inf")
    bad = save_dir(tmp_path / "bad", sd)
    with pytest.raises(MergeError, match=r"bad/model.safetensors: tensor 'model.norm.weight' has 1 non-finite"):
        merge_checkpoints([bad, dirs[1]], tmp_path / "out", method, base=base_dir if method == "ties" else None, **params)
    assert_nothing_written(tmp_path)


def test_float16_overflow_is_refused(tmp_path):
    dirs = [save_dir(tmp_path / f"c{i}", {"w": torch.full((3,), 1e6)}) for i in range(2)]
    with pytest.raises(MergeError, match=r"'w' has values beyond the range of torch.float16.*wider --dtype"):
        merge_checkpoints(dirs, tmp_path / "out", "sma", dtype="float16")
    assert_nothing_written(tmp_path)


def test_failure_while_writing_leaves_nothing(models, tmp_path, monkeypatch):
    _, dirs, _, _ = models
    from hybridflow.merge import safetensors_io

    calls = []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full")
        original(self, name, tensor)

    original = safetensors_io.ShardedWriter.write
    monkeypatch.setattr(safetensors_io.ShardedWriter, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        merge_checkpoints(dirs, tmp_path / "out", "sma", max_shard_bytes=300)
    assert_nothing_written(tmp_path)


def test_existing_output_needs_overwrite(models, tmp_path):
    _, dirs, _, _ = models
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(MergeError, match="already exists.*overwrite"):
        merge_checkpoints(dirs, tmp_path / "out", "sma")
    merge_checkpoints(dirs, tmp_path / "out", "sma", overwrite=True)
    assert not (tmp_path / "out" / "old.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_output_inside_an_input_is_refused(models, tmp_path):
    _, dirs, _, _ = models
    with pytest.raises(MergeError, match="is or contains the input"):
        merge_checkpoints(dirs, dirs[0], "sma", overwrite=True)


def test_base_without_use_is_refused(models, tmp_path):
    base_dir, dirs, _, _ = models
    with pytest.raises(MergeError, match="does not use a base model"):
        merge_checkpoints(dirs, tmp_path / "out", "sma", base=base_dir)


def test_unknown_format_names_the_path(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(MergeError, match=r"dcp: looks like a torch.distributed.checkpoint"):
        merge_checkpoints([tmp_path / "dcp"], tmp_path / "out", "sma")


# ------------------------------------------------------------------ run layout and CLI


def make_run(tmp_path, steps, complete):
    for step in steps:
        step_dir = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
        save_dir(step_dir / "hf", tiny_state(step))
        if step in complete:
            (step_dir / "COMPLETE").touch()
    return tmp_path / "run"


def test_last_checkpoints_orders_by_step_and_skips_incomplete(tmp_path):
    run = make_run(tmp_path, [5, 100, 20, 300], complete={5, 20, 100})
    assert [p.parent.name for p in last_checkpoints(run, 2)] == ["step_00000020", "step_00000100"]
    with pytest.raises(MergeError, match=r"3 complete checkpoints \(step_00000005, step_00000020, step_00000100\) "
                                         r"but 4 were asked for; incomplete \(no COMPLETE file\): step_00000300"):
        last_checkpoints(run, 4)


def test_cli_merges_last_n(tmp_path, capsys):
    run = make_run(tmp_path, [1, 2, 3], complete={1, 2, 3})
    assert main(["--method", "wma", "--output", str(tmp_path / "out"), "--last", "2", str(run), "--dtype", "bfloat16"]) == 0
    merged = load_dir(tmp_path / "out")
    a, b = (tiny_state(s)["model.norm.weight"] for s in (2, 3))
    assert torch.equal(merged["model.norm.weight"], (a / 3 + b * 2 / 3).to(torch.bfloat16))
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")


@pytest.mark.parametrize("argv, message", [
    (["--method", "avg", "--output", "OUT", "x"], "unknown merge method 'avg'"),
    (["--method", "ema", "--output", "OUT", "IN0", "IN1"], "needs 'alpha'"),
    (["--method", "sma", "--output", "OUT", "IN0", "missing"], "checkpoint missing does not exist"),
    (["--method", "sma", "--output", "OUT", "--last", "3", "RUN"], "has no checkpoints/ directory"),
])
def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    save_dir(tmp_path / "IN0", tiny_state(1))
    save_dir(tmp_path / "IN1", tiny_state(2))
    (tmp_path / "RUN").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "OUT").exists()


def test_cli_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--method", "sma", "--output", "OUT", "--shard-size", "2XB", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "'2XB' is not a size" in err


def test_merge_state_dicts_ema_step_and_no_aliasing():
    # one EMA update of a reference model: ref' = (1 - a) ref + a actor, with a = .25
    ref, actor = tiny_state(1), tiny_state(2)
    merged = merge_state_dicts([ref, actor], "ema", alpha=0.25)
    assert torch.allclose(merged["model.norm.weight"], 0.75 * ref["model.norm.weight"] + 0.25 * actor["model.norm.weight"])
    assert torch.equal(merged["model.step_count"], actor["model.step_count"])
    assert merged["model.step_count"].data_ptr() != actor["model.step_count"].data_ptr()
