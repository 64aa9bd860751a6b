"""The memory floor of a run's actor processes, and the refusal of a run that cannot fit
(hybridflow/checks/memory_budget.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.config import compose
from hybridflow.planning.plan import Plan
from hybridflow.checks.memory_budget import (GIB, ModelShape, choose_micro_batch, memory_problems, process_terms,
                                      resolve_micro_batches)

ROOT = Path(__file__).resolve().parents[2]
# Qwen2.5-0.5B's shapes (tied embeddings): 494,032,768 parameters
QWEN05 = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
          "num_attention_heads": 14, "num_key_value_heads": 2}

# these numbers were worked out for bfloat16
# compute over float32 masters with a float32 engine, so they pin that on every CPU kind
PINNED = ["model.dtype=bfloat16", "rollout.dtype=float32"]


def plan_of(config) -> Plan:
    """The plan a run of `config` carries (placement=auto off): its pools, ranks and rollout TP."""
    return Plan.from_config(config)


def with_plan(config) -> tuple:
    """(config, its plan): the first two arguments of the memory model's functions."""
    return config, plan_of(config)


def qwen05_shapes() -> dict[str, list[int]]:
    return qwen2_shapes(896, 4864, 151936, 2 * 64, 24, tied=True)


def qwen2_shapes(h: int, i: int, v: int, kv: int, layers: int, tied: bool) -> dict[str, list[int]]:
    """A Qwen2 checkpoint's tensor names and shapes (`kv`: key/value heads x head size)."""
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], **({} if tied else {"lm_head.weight": [v, h]})}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": [h, h], p + "self_attn.q_proj.bias": [h],
                       p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.k_proj.bias": [kv],
                       p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.v_proj.bias": [kv],
                       p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [i, h],
                       p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
                       p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]})
    return shapes


def header_only_model(directory: Path, tokenizer_dir: Path, config: dict | None = None,
                      shapes: dict[str, list[int]] | None = None) -> Path:
    """A model directory whose safetensors file has Qwen2.5-0.5B's header (or `config` and `shapes`'s) and no
    data: enough for every check before start (which reads headers only), 2 GB smaller than the real thing."""
    directory.mkdir(parents=True)
    config = config or {"tie_word_embeddings": True, **QWEN05}
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                       **config}))
    header = json.dumps({n: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]}
                         for n, s in (shapes or qwen05_shapes()).items()}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, directory / f.name)
    return directory


def test_model_shape_reads_the_exact_parameter_count_from_the_headers(tmp_path, tiny_model_dir):
    shape = ModelShape.from_dir(header_only_model(tmp_path / "m", tiny_model_dir))
    assert shape == ModelShape(parameters=494_032_768, layers=24, hidden=896, intermediate=4864, heads=14, vocab=151936,
                               kv_width=2 * 64)  # 2 key/value heads of 896 / 14
    assert ModelShape.from_dir(tmp_path / "missing") is None


def test_process_terms_worked_example():
    """SmolLM2-135M (134,515,008 parameters), float32 masters over 2 ranks, float32 engine, 16 rows of
    64 + 64 tokens: parameters 134.5M x 4 B / 2 = 0.25 GiB, gradients the same, AdamW twice that,
    the engine's full copy 0.50 GiB, the KV cache 1 GiB; activations 16 x 128 tokens x 30 layers x
    (10 x 576 + 4 x 1536 + 2 x 9 x 128 = 14,208 floats) x 4 B = 3.25 GiB; logits and their gradient
    2 x 16 x 64 x 49,152 x 4 B = 0.375 GiB; the process's runtime 0.75 GiB with an engine (0.5 without);
    the embeddings FSDP2 keeps gathered through the micro-batch, and their gradient, 2 x 49,152 x 576 x 4 B
    (tied; twice that untied, none on one rank without mixed precision)."""
    shape = ModelShape(parameters=134_515_008, layers=30, hidden=576, intermediate=1536, heads=9, vocab=49152)
    config = compose(["model=local_hf", "model.path=/m", "model.dtype=float32", "data.max_prompt_tokens=64",
                      "rollout.max_response_tokens=64", "actor.samples_per_micro_batch=16"])
    terms = {k.split(" (")[0]: v / GIB
             for k, v in process_terms(*with_plan(config), shape, {"actor", "rollout"}).items()}
    assert terms["actor parameters"] == pytest.approx(134_515_008 * 4 / 2 / GIB)
    assert terms["actor AdamW moments"] == pytest.approx(2 * terms["actor gradients"])
    assert terms["vLLM weights"] == pytest.approx(134_515_008 * 4 / GIB) and terms["vLLM KV cache"] == 1.0
    assert terms["activations of one micro-batch"] == pytest.approx(16 * 128 * 30 * 14208 * 4 / GIB)
    assert terms["its logits and their gradient"] == pytest.approx(0.375)
    assert terms["the process's own runtime"] == 0.75
    assert terms["actor embeddings gathered, and their gradient"] == pytest.approx(2 * 49152 * 576 * 4 / GIB)
    untied = dataclasses.replace(shape, tied_embeddings=False)
    alone = {k.split(" (")[0]: v / GIB for k, v in process_terms(config, plan_of(config), untied, {"actor"}).items()}
    assert alone["actor embeddings gathered, and their gradient"] == pytest.approx(4 * 49152 * 576 * 4 / GIB)
    assert alone["the process's own runtime"] == 0.5 and "vLLM weights" not in alone
    one_rank = compose(["model=local_hf", "model.path=/m", "model.dtype=float32", "placement.pools.global.devices_per_node=1"])
    assert not any(k.startswith("actor embeddings")
                   for k in process_terms(*with_plan(one_rank), shape, {"actor"}, rows=1))
    checkpointed = compose(["model=local_hf", "model.path=/m", "model.dtype=float32", "rollout.max_response_tokens=64",
                            "actor.gradient_checkpointing=true", "actor.samples_per_micro_batch=16"])
    activations = [v for k, v in process_terms(*with_plan(checkpointed), shape, {"actor"}).items()
                   if k.startswith("activations")]
    assert activations[0] < 0.2 * GIB  # one hidden vector per layer, and one layer recomputed


def test_a_run_that_cannot_fit_is_refused_with_the_arithmetic(tmp_path, tiny_model_dir):
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", "placement.device=cpu", *PINNED]
    assert memory_problems(*with_plan(compose(base)), node_bytes=24 * GIB) == []  # 2 processes of ~7 GiB fit in 24 GiB
    # 8 processes on the node: each still holds the engine's full copy (1.84 GiB) and a 1 GiB KV cache
    refused = memory_problems(*with_plan(compose([*base, "placement.pools.global.devices_per_node=8"])),
                              node_bytes=24 * GIB)
    assert len(refused) == 1
    text = refused[0]
    assert "494M parameters, 24 layers" in text and "each of the 8 processes" in text
    assert "actor AdamW moments" in text and "vLLM KV cache" in text and "GiB per node, above the 22.80 GiB" in text
    assert "actor.gradient_checkpointing=true" in text


def test_the_command_refuses_it_before_anything_starts(tmp_path, tiny_model_dir):
    """The same refusal from the `hybridflow` command, exit status 2: no Ray, no model, no run directory."""
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by this command would write its session
    done = subprocess.run([str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "model=local_hf",
                           f"model.path={model}", "placement.device=cpu", *PINNED, "placement.pools.global.devices_per_node=8",
                           f"logger.output_root={tmp_path / 'runs'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "does not fit" in done.stderr + done.stdout and "actor AdamW moments" in done.stderr + done.stdout
    assert not ray_tmp.exists(), "Ray was started"
    assert not (tmp_path / "runs").exists()  # nothing was made


SMOLLM2 = ModelShape(parameters=134_515_008, layers=30, hidden=576, intermediate=1536, heads=9, vocab=49152)
QWEN05_SHAPE = ModelShape(parameters=494_032_768, layers=24, hidden=896, intermediate=4864, heads=14, vocab=151936)
REAL = ["model=local_hf", "model.path=/m", "placement.device=cpu", "data.max_prompt_tokens=64",
        "rollout.max_response_tokens=64", *PINNED]


def test_left_unset_the_micro_batch_is_the_most_rows_whose_floor_fits_the_memory_available():
    """SmolLM2 in float32 on 2 ranks of a 24 GiB node: a process may use 2/3 x 0.95 x 24 / 2 = 7.6 GiB.
    Fixed terms 3.46 GiB (parameters 0.25, gradients 0.25, AdamW 0.50, engine 0.50, KV cache 1.0,
    runtime 0.75, the gathered embeddings and their gradient 2 x 49,152 x 576 x 4 B = 0.21); a row costs
    128 x 30 x 14,208 x 4 B = 0.2032 GiB of activations and 2 x 64 x 49,152 x 4 B = 0.0234 GiB of logits:
    (7.6 - 3.46) / 0.2267 = 18.3, so 18 rows, without checkpointing (18 >= 8)."""
    choice = choose_micro_batch(*with_plan(compose([*REAL, "model.dtype=float32"])), SMOLLM2, node_bytes=24 * GIB)
    assert (choice.rows, choice.gradient_checkpointing) == (18, False)
    # a 0.5B model with a bfloat16 engine leaves room for no row without checkpointing: recompute, 15 rows
    qwen = choose_micro_batch(*with_plan(compose([*REAL, "rollout.dtype=bfloat16"])), QWEN05_SHAPE, node_bytes=24 * GIB)
    assert (qwen.rows, qwen.gradient_checkpointing) == (15, True)
    # with a float32 engine even its fixed terms (8.3 GiB) pass the share: the smallest, and a warning
    fp32 = choose_micro_batch(*with_plan(compose([*REAL, "model.dtype=float32"])), QWEN05_SHAPE, node_bytes=24 * GIB)
    assert (fp32.rows, fp32.gradient_checkpointing) == (1, True)
    assert fp32.why.startswith("WARNING") and "rollout.dtype" in fp32.why
    # on a large node the cap: 64 rows
    assert choose_micro_batch(*with_plan(compose([*REAL, "model.dtype=float32"])), SMOLLM2,
                              node_bytes=512 * GIB).rows == 64


def test_the_choice_is_the_largest_that_fits_and_respects_what_the_user_set():
    from hybridflow.checks.memory_budget import AUTO_SHARE, NODE_MEMORY_SHARE, actor_pool_roles

    for extra in ([], ["model.dtype=float32"], ["rollout.max_response_tokens=512"],
                  ["placement.pools.global.devices_per_node=1"]):
        config = compose([*REAL, *extra])
        choice = choose_micro_batch(config, plan_of(config), SMOLLM2, node_bytes=24 * GIB)
        budget = AUTO_SHARE * NODE_MEMORY_SHARE * 24 * GIB / config.placement.pools["global"].devices_per_node

        def floor(rows: int) -> float:
            return sum(process_terms(*with_plan(config), SMOLLM2, actor_pool_roles(*with_plan(config)), rows,
                                     choice.gradient_checkpointing).values())
        assert floor(choice.rows) <= budget and (choice.rows == 64 or floor(choice.rows + 1) > budget), extra
    set_rows = choose_micro_batch(*with_plan(compose([*REAL, "actor.samples_per_micro_batch=4"])), SMOLLM2,
                                  node_bytes=24 * GIB)
    assert (set_rows.rows, set_rows.gradient_checkpointing) == (4, False)
    forced = choose_micro_batch(*with_plan(compose([*REAL, "actor.gradient_checkpointing=true"])), SMOLLM2,
                                node_bytes=24 * GIB)
    assert forced.gradient_checkpointing and forced.rows == 64  # checkpointed rows are cheap


def test_resolve_fills_in_only_the_null_keys_and_says_what_it_chose(tmp_path, tiny_model_dir):
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    config, said = resolve_micro_batches(*with_plan(compose(["model=local_hf", f"model.path={model}",
                                                             "placement.device=cpu", "model.dtype=float32"])),
                                         node_bytes=24 * GIB)
    assert config.actor.samples_per_micro_batch == config.critic.samples_per_micro_batch >= 1
    assert config.actor.gradient_checkpointing is True
    assert "actor.samples_per_micro_batch=" in said and "actor.gradient_checkpointing=true" in said
    again, nothing = resolve_micro_batches(config, plan_of(config), node_bytes=24 * GIB)
    assert again == config and nothing is None
    tiny, _ = resolve_micro_batches(*with_plan(compose(["recipe=grpo"])))  # the tiny model: size known only at start
    assert tiny.actor.samples_per_micro_batch == 64 and tiny.actor.gradient_checkpointing is False


# ---- on GPUs ---------------------------------------------------------------------------------------

QWEN15_SHAPE = ModelShape(parameters=1_543_714_304, layers=28, hidden=1536, intermediate=8960, heads=12, vocab=151936)
GPU = ["model=local_hf", "model.path=/m", "placement.device=cuda", "model.dtype=bfloat16", "model.master_dtype=float32",
       "data.max_prompt_tokens=256", "rollout.max_response_tokens=512"]
# bench/gpu_check.py on one NVIDIA H200, 2026-11-27 (docs/memory.md "A GPU memory model"): the actor,
# one rank, 16 rows of 256 + 512 tokens, no checkpointing; torch.cuda.max_memory_allocated in the update,
# GiB, (padded, packed)
H200_PEAKS_GIB = {"0.5B": (34.4, 32.0), "1.5B": (69.8, 65.6)}


def test_the_gpu_floor_is_below_the_measured_h200_peaks_within_one_and_a_half_times():
    """0.5B: parameters, gradients and AdamW moments 494M x 4 B x 4 = 7.36 GiB, the gathered embeddings
    and their gradient 2 x 151,936 x 896 x 2 B = 0.51, activations 16 x 768 x 24 x (10 x 896 + 4 x 4864)
    x 2 B = 15.6 (no attention probabilities: GPU kernels keep none), logits and their gradient
    2 x 16 x 512 x 151,936 x 2 B = 4.64: 28.1 GiB, no host runtime. 1.5B the same way: 61.3 GiB. Beside them
    the process's CUDA context (0.5 GiB, an estimate), which the device holds but torch's allocator, whose
    peak is compared, does not count."""
    config = compose([*GPU, "placement.pools.global.devices_per_node=1", "actor.samples_per_micro_batch=16",
                      "actor.gradient_checkpointing=false"])
    for name, shape, floor_gib in (("0.5B", QWEN05_SHAPE, 28.1), ("1.5B", QWEN15_SHAPE, 61.3)):
        terms = process_terms(config, plan_of(config), shape, {"actor", "rollout"})
        assert not any("runtime" in k or "vLLM" in k for k in terms), terms  # asleep while training; host memory
        assert terms.pop("CUDA context and cuBLAS workspace (per GPU process; estimate)") == 0.5 * GIB
        floor = sum(terms.values()) / GIB
        assert floor == pytest.approx(floor_gib, abs=0.05), name
        for peak in H200_PEAKS_GIB[name]:
            assert floor <= peak <= 1.5 * floor, (name, floor, peak)
    cpu = compose([*GPU[:2], "placement.device=cpu", *GPU[3:], "placement.pools.global.devices_per_node=1",
                   "actor.samples_per_micro_batch=16", "actor.gradient_checkpointing=false"])
    assert sum(process_terms(*with_plan(cpu), QWEN15_SHAPE, {"actor"}).values()) / GIB > 73  # eager attention's probabilities


def test_on_a_gpu_the_micro_batch_is_chosen_from_its_memory(tmp_path, monkeypatch):
    """An 80 GiB GPU, 1.5B: fixed terms 23.0 + 0.87 GiB and the CUDA context's 0.5, a row 768 x 28 x 51,200 x 2 B =
    2.05 GiB of activations and 0.29 of logits: (2/3 x 80 - 24.4) / 2.34 = 12.4, so 12 rows without
    checkpointing; 0.5B: 35 rows."""
    from hybridflow.checks.memory_budget import AUTO_SHARE, actor_pool_roles

    config = compose([*GPU, "placement.pools.global.devices_per_node=1"])
    for shape, rows in ((QWEN15_SHAPE, 12), (QWEN05_SHAPE, 35)):
        choice = choose_micro_batch(config, plan_of(config), shape, gpu_bytes=80 * GIB)
        assert (choice.rows, choice.gradient_checkpointing) == (rows, False), choice
        assert "of the 80.0 GiB one GPU holds" in choice.why

        def floor(r: int) -> float:
            return sum(process_terms(*with_plan(config), shape, actor_pool_roles(*with_plan(config)), r, False).values())
        assert floor(rows) <= AUTO_SHARE * 80 * GIB < floor(rows + 1)
    # 40 GiB: (26.7 - 24.4) / 2.34 is 0 rows without checkpointing, so recompute: a row is then 768 x
    # (1536 x 28 + 51,200) x 2 B = 0.135 GiB of activations and still 0.29 of logits, 5 rows
    small = choose_micro_batch(config, plan_of(config), QWEN15_SHAPE, gpu_bytes=40 * GIB)
    assert (small.rows, small.gradient_checkpointing) == (5, True)
    from hybridflow.checks import memory_budget

    fake = tmp_path / "bin"
    fake.mkdir()
    monkeypatch.setenv("PATH", str(fake))  # no nvidia-smi: a driver without a GPU
    unknown = choose_micro_batch(config, plan_of(config), QWEN15_SHAPE)  # and no placement.gpu_memory_gib
    assert unknown.rows == 16 and "placement.gpu_memory_gib" in unknown.why
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho \"NVIDIA A100-SXM4-80GB, 81559\"\n")  # as nvidia-smi reports it (MiB)
    (fake / "nvidia-smi").chmod(0o755)
    assert memory_budget.gpu_memory_bytes(config) == 81559 * 2 ** 20
    assert choose_micro_batch(config, plan_of(config), QWEN15_SHAPE).rows == 12
    told = choose_micro_batch(*with_plan(compose([*GPU, "placement.pools.global.devices_per_node=1",
                                       "placement.gpu_memory_gib=80"])), QWEN15_SHAPE)
    assert (told.rows, told.gradient_checkpointing) == (12, False)


def test_on_a_gpu_each_phase_of_the_colocated_hand_over_is_checked_with_its_arithmetic(tmp_path, tiny_model_dir):
    """0.5B on a 12 GiB GPU with a colocated engine (share 0.5), each phase beside the process's CUDA context
    (0.5 GiB): start 494M x 4 B = 1.84 GiB of actor weights beside the engine's 0.5 x 12 = 6 GiB: 8.34; the
    weight sync the actor's parameters and AdamW moments 5.52 GiB (its gradients freed at the end of the update)
    beside the engine's weights alone (494M x 2 B = 0.92 GiB, its KV cache still freed) and a 64 MiB bucket:
    7.0 GiB; generation the engine's 6 GiB alone (the actor offloaded): 6.5. All fit, although the sync of the
    order before (the engine woken whole beside the training state) did not. A share of 0.9 cannot start: 0.5 + 1.84 + 10.8 = 13.14 GiB (nor
    generate: 0.5 + 10.8 = 11.3);
    with 90% of the GPU usable (GPU_MEMORY_SHARE: fragmentation and transient buffers take the rest),
    (0.9 x 12 - 2.34) / 12 = 0.70 is the most that starts."""
    from hybridflow.checks.memory_budget import actor_pool_roles, gpu_phase_terms

    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", *GPU[2:], "placement.pools.global.devices_per_node=1"]
    config = resolve_micro_batches(*with_plan(compose(base)), gpu_bytes=12 * GIB)[0]
    plan = plan_of(config)
    phases = {k: sum(v.values()) / GIB
              for k, v in gpu_phase_terms(config, plan, QWEN05_SHAPE, actor_pool_roles(config, plan), 12 * GIB).items()}
    assert list(phases) == ["training", "start", "weight sync", "generation"]
    assert (round(phases["start"], 2), round(phases["weight sync"], 2), phases["generation"]) == (8.34, 7.0, 6.5)
    sync = gpu_phase_terms(config, plan, QWEN05_SHAPE, actor_pool_roles(config, plan), 12 * GIB)["weight sync"]
    assert not any("gradient" in k and "freed" not in k for k in sync), sync  # freed before the sync (training/loop.py)
    assert memory_problems(*with_plan(compose(base)), gpu_bytes=12 * GIB) == []
    problems = memory_problems(*with_plan(compose([*base, "rollout.gpu_memory_utilization=0.9"])), gpu_bytes=12 * GIB)
    assert len(problems) == 2 and "does not fit when the colocated vLLM engine starts" in problems[0], problems
    assert "13.14 GiB" in problems[0] and "rollout.gpu_memory_utilization=0.70 or lower" in problems[0]
    assert "does not fit while the colocated vLLM engine generates" in problems[1]  # 0.5 + 10.8 = 11.3 GiB
    assert "rollout.gpu_memory_utilization=0.86 or lower" in problems[1]
    assert "above 90% of the GPU's 12.0 GiB (10.8 GiB" in problems[0]
    own_pool = [*base, "rollout.gpu_memory_utilization=0.9", "+placement.pools.gen={devices_per_node:1}",
                "placement.roles.rollout=gen"]
    assert memory_problems(*with_plan(compose(own_pool)), gpu_bytes=12 * GIB) == []  # no engine beside the actor
    training = memory_problems(*with_plan(compose(base)), gpu_bytes=6 * GIB)
    assert "does not fit while it trains" in training[0] and "more GPUs in the actor's pool" in training[0]


# Qwen2.5-14B's shapes (untied embeddings): 14,770,033,664 parameters
QWEN14 = {"vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
          "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False}


def qwen14_model(directory: Path, tokenizer_dir: Path) -> Path:
    return header_only_model(directory, tokenizer_dir, QWEN14, qwen2_shapes(5120, 13824, 152064, 8 * 128, 48, tied=False))


def test_a_weight_sync_that_cannot_fit_an_80_gib_gpu_is_refused_with_the_arithmetic(tmp_path, tiny_model_dir):
    """Qwen2.5-14B on 4 GPUs of 80 GiB, a float32 engine colocated at TP 1: each GPU keeps its quarter of the
    float32 parameters and AdamW moments (14.77B x 12 B / 4 = 41.3 GiB; the gradients are freed at the end of
    the update) while the engine's whole float32 copy wakes (55.0 GiB), with a 64 MiB bucket and the process's
    CUDA context and NCCL buffers (0.5 + 0.25): 97.10 GiB. Training fits (55.0 + 5.8 of gathered embeddings and
    their gradient + one checkpointed row), and so does the engine at TP 4 (13.8 GiB a rank). With a bfloat16
    engine the sync fits too (41.3 + 27.5 + 0.8 = 69.6 GiB), where it did not while the gradients stayed
    (83.35 GiB)."""
    model = qwen14_model(tmp_path / "qwen14", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", *GPU[2:], "placement.pools.global.devices_per_node=4",
            "placement.gpu_memory_gib=80"]
    assert memory_problems(*with_plan(compose(base))) == []
    base.append("rollout.dtype=float32")
    problems = memory_problems(*with_plan(compose(base)))
    assert len(problems) == 1 and "does not fit at the weight sync" in problems[0], problems
    assert "97.10 GiB" in problems[0] and "55.02 GiB  vLLM weights awake (rollout.dtype, 1/1 of the model" in problems[0]
    assert "actor gradients" not in problems[0]
    assert "a larger rollout.tensor_parallel_size" in problems[0]
    assert memory_problems(*with_plan(compose([*base, "rollout.tensor_parallel_size=4"]))) == []


def test_a_gpu_run_whose_weight_sync_cannot_fit_is_refused_before_ray_starts(tmp_path, tiny_model_dir):
    """The same 14B run (a float32 engine) from the command line: status 2 with the arithmetic, before Ray or
    any worker starts."""
    model = qwen14_model(tmp_path / "qwen14", tiny_model_dir)
    output_root = tmp_path / "runs"
    cmd = [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "model=local_hf", f"model.path={model}", *GPU[2:],
           "placement.pools.global.devices_per_node=4", "placement.gpu_memory_gib=80", "rollout.dtype=float32",
           f"logger.output_root={output_root}", "logger.run_name=big"]
    ray_tmp = tmp_path / "ray_tmp"  # where a Ray started by this command would write its session
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "does not fit at the weight sync" in result.stderr and "97.10 GiB" in result.stderr, result.stderr[-3000:]
    assert not ray_tmp.exists(), "Ray was started"
    assert not output_root.exists()  # nothing was made


@pytest.mark.parametrize("report", ["gpu_handover_h200.json", "gpu_handover_3b_80gib_h200.json", "gpu_check_h200.json"])
def test_each_phase_floor_is_below_its_h200_peak_within_one_and_a_half_times(report):
    """bench/gpu_check.py part 4 on one NVIDIA H200 (docs/resharding.md "The colocated hand-over on GPUs"):
    the colocated hand-over through the transport's own sequence, each phase's measured peak at or above
    the floor the model gives today for the bench's config, and at most 1.5x it. The weight sync's was measured
    while the gradients stayed through it: its recorded floor is today's plus the gradients the loop now frees
    at the end of the update (hybridflow/training/loop.py), against which its peak is read."""
    from hybridflow.checks.memory_budget import gpu_phase_terms, gpu_process_terms

    sizes = {"0.5b": QWEN05_SHAPE, "1.5b": QWEN15_SHAPE,
             "3b": ModelShape(parameters=3_085_938_688, layers=36, hidden=2048, intermediate=11008, heads=16,
                              vocab=151936)}
    measured = json.loads((ROOT / "bench" / "results" / report).read_text())
    parts = [v for k, v in measured.items() if k.startswith("handover_")]
    assert parts
    for part in parts:
        config = compose([*GPU, "placement.pools.global.devices_per_node=1", "rollout.dtype=bfloat16",
                          f"actor.samples_per_micro_batch={part['rows_per_micro_batch']}",
                          "actor.gradient_checkpointing=false", f"rollout.gpu_memory_utilization={part['share']}"])
        floors = gpu_phase_terms(*with_plan(config), sizes[part["size"]], {"actor", "rollout"},
                                 int(part["gpu_gib"] * GIB))
        for phase, row in part["phases"].items():  # the terms torch's allocator counts, as its peak does
            floor = sum(v for k, v in floors[phase].items() if k not in gpu_process_terms(1)) / GIB
            if phase == "weight sync":  # measured with the gradients held: float32, one per parameter
                floor += sizes[part["size"]].parameters * 4 / GIB
            assert floor == pytest.approx(row["floor_gib"], abs=0.01), (part["size"], phase)
            assert floor <= row["peak_gib"] <= 1.5 * floor, (part["size"], phase, floor, row["peak_gib"])


def test_a_gpu_node_whose_host_memory_cannot_hold_the_hand_over_is_refused_naming_the_sleep_level(
        tmp_path, tiny_model_dir):
    """Qwen2.5-14B on a node of 8 GPUs of 80 GiB, the engine colocated at TP 1: each process keeps in host
    memory the actor's float32 parameters and AdamW moments offloaded while the engine generates
    (14.77B x 12 B / 8 = 20.63 GiB, page-locked and kept by PyTorch's host allocator), its runtime (0.75 GiB)
    and, at rollout.sleep_level=1, the engine's bfloat16 weights while the actor trains (27.51 GiB): 48.89
    GiB x 8 = 391.2 GiB, above 95% of a 256 GiB node. At level 2 (the default: the engine's weights are
    discarded) 21.38 x 8 = 171.0 GiB fits. A driver that does not know the node's memory checks nothing."""
    model = qwen14_model(tmp_path / "qwen14", tiny_model_dir)
    base = ["recipe=grpo", "model=local_hf", f"model.path={model}", *GPU[2:], "placement.pools.global.devices_per_node=8",
            "placement.gpu_memory_gib=80"]
    assert compose(base).rollout.sleep_level == 2
    assert memory_problems(*with_plan(compose(base)), node_bytes=256 * GIB) == []
    problems = memory_problems(*with_plan(compose([*base, "rollout.sleep_level=1"])), node_bytes=256 * GIB)
    assert len(problems) == 1 and "does not fit in a node's host memory" in problems[0], problems
    assert "48.89 GiB" in problems[0] and "391.16 GiB per node" in problems[0], problems[0]
    assert "27.51 GiB  engine weights asleep while the actor trains (rollout.sleep_level=1" in problems[0]
    assert "Fix: rollout.sleep_level=2" in problems[0]
    assert memory_problems(*with_plan(compose([*base, "rollout.sleep_level=1"])), node_bytes=1024 * GIB) == []


def test_an_hf_run_whose_kv_cache_and_prefill_logits_cannot_fit_is_refused_with_the_arithmetic(tmp_path,
                                                                                              tiny_model_dir):
    """Qwen2.5-0.5B on a 12 GiB GPU with the hf engine (bfloat16), 512 + 1536 tokens, 64 prompts x 8 samples.
    At generation the engine holds its own copy of the weights (494M x 2 B = 0.92 GiB), a KV cache of
    rollout.max_num_seqs rows at full length, keys and values of 24 layers of 2 heads x 64: a row 2048 x 2 x 24
    x 128 x 2 B = 24 MiB, 512 rows 12 GiB, and the prefill's logits at one position (512 x 151,936 x 2 B =
    0.14 GiB), beside the CUDA context (0.5): 13.57 GiB, above the 10.8 usable. A row costs 24.29 MiB, so
    (10.8 - 1.42) GiB / 24.29 MiB = 395 rows fit; at 256 rows (6.0 GiB of cache) the run fits. Its start
    and weight sync are priced too (the engine's copy beside the actor's state), and the exact engine's
    generation is the actor's parameters beside a KV cache of its micro-batch's rows and one position's logits."""
    from hybridflow.checks.memory_budget import actor_pool_roles, gpu_phase_terms

    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", "placement.device=cuda", "model.dtype=bfloat16",
            "model.master_dtype=float32", "data.max_prompt_tokens=512", "rollout.max_response_tokens=1536",
            "rollout.backend=hf", "placement.pools.global.devices_per_node=1", "trainer.prompts_per_step=64",
            "rollout.samples_per_prompt=8"]
    problems = memory_problems(*with_plan(compose([*base, "rollout.max_num_seqs=512"])), gpu_bytes=12 * GIB)
    assert len(problems) == 1 and "does not fit while the colocated hf engine generates" in problems[0], problems
    text = problems[0]
    assert "13.57 GiB" in text and "12.00 GiB  hf engine KV cache (512 rows" in text
    assert "0.92 GiB  hf engine weights" in text and "0.14 GiB  hf engine prefill logits (512 rows" in text
    assert "rollout.max_num_seqs=395 or lower (24.3 MiB a row)" in text
    fits = compose([*base, "rollout.max_num_seqs=256"])
    assert memory_problems(*with_plan(fits), gpu_bytes=12 * GIB) == []
    config = resolve_micro_batches(*with_plan(fits), gpu_bytes=12 * GIB)[0]
    plan = plan_of(config)
    phases = gpu_phase_terms(config, plan, QWEN05_SHAPE, actor_pool_roles(config, plan), 12 * GIB)
    assert list(phases) == ["training", "start", "weight sync", "generation"]
    assert "hf engine weights (rollout.dtype, its own copy)" in phases["weight sync"]
    assert not any("gradients" in k and "freed" not in k for k in phases["weight sync"])
    exact = compose([*base, "rollout.backend=exact", "actor.samples_per_micro_batch=4", "rollout.top_p=1.0"])
    config, plan = with_plan(exact)
    terms = gpu_phase_terms(config, plan, QWEN05_SHAPE, actor_pool_roles(config, plan), 12 * GIB)
    assert list(terms) == ["training", "generation"]  # no copy, so no start of its own and no weight sync
    logits = [v for k, v in terms["generation"].items() if k.startswith("one decode step's logits (4 rows")]
    assert logits == [4 * 151936 * 2]  # rows x one position x vocabulary, bfloat16
    cache = [v for k, v in terms["generation"].items() if k.startswith("exact engine KV cache (4 rows")]
    assert cache == [4 * 2048 * QWEN05_SHAPE.kv_floats_per_token * 2]  # rows x (prompt + response) x key/value floats, bf16
    assert terms["generation"]["actor parameters (model.master_dtype, FSDP shard)"] == 494_032_768 * 4


def test_sequence_parallel_halves_the_activation_term_and_adds_its_buffers():
    """Qwen2.5-0.5B's shapes, one packed row of 512 + 8,192 tokens, bfloat16 compute, on 2 CPU ranks. SP 1:
    8,704 tokens x 24 layers x (10 x 896 + 4 x 4864 = 28,416 floats) x 2 B = 11.1 GiB (packed rows attend
    in one fused kernel: no probabilities kept, measured by bench/sequence_parallel.py; the padded path's
    eager attention keeps 2 x 14 x 8,704 more floats a token: 105.9 GiB). SP 2: the packed row split in two,
    4,352 tokens a rank, the same floats per token: half, 5.5 GiB. Its logits at the 4,352 response positions
    a rank holds at most (of 8,192): 2 x 4352 x 151,936 x 2 B. The all-to-all's send copy and receive buffer
    of the largest call (the query's, 4,352 tokens x 14 heads x 64): 2 x 4352 x 896 x 2 B = 14.9 MiB; the
    gathered log-probs and entropy, whole on every rank: 2 x 3 x 8192 x 4 B. The parameters, gradients and
    moments do not change (FSDP2 shards over both ranks either way)."""
    base = ["model=local_hf", "model.path=/m", "placement.device=cpu", *PINNED, "data.max_prompt_tokens=512",
            "rollout.max_response_tokens=8192", "actor.samples_per_micro_batch=1",
            "actor.gradient_checkpointing=false", "model.pack_sequences=true"]
    terms = {}
    for sp in (1, 2):
        config = compose([*base, f"actor.sequence_parallel_size={sp}"])
        terms[sp] = {k.split(" (")[0]: v for k, v in process_terms(*with_plan(config), QWEN05_SHAPE,
                                                                       {"actor", "rollout"}).items()}
    one, two = terms[1], terms[2]
    per_token = 24 * (10 * 896 + 4 * 4864) * 2
    assert one["activations of one micro-batch"] == 8704 * per_token
    assert two["activations of one micro-batch"] == 4352 * per_token == one["activations of one micro-batch"] / 2
    assert one["its logits and their gradient"] == 2 * 8192 * 151936 * 2
    assert two["its logits and their gradient"] == 2 * 4352 * 151936 * 2
    buffers = {k: v for k, v in two.items() if k.startswith("sequence parallel 2")}
    assert list(buffers.values()) == [2 * 4352 * 896 * 2, 2 * 3 * 8192 * 4], buffers
    assert not any(k.startswith("sequence parallel") for k in one)
    for k in ("actor parameters", "actor gradients", "actor AdamW moments", "vLLM weights"):
        assert one[k] == two[k]
    activation_one = one["activations of one micro-batch"]
    activation_two = two["activations of one micro-batch"] + sum(buffers.values())
    assert 0.5 < activation_two / activation_one < 0.502
    padded = compose([*base[:-1], "actor.sequence_parallel_size=1"])  # model.pack_sequences left to the model
    activations = next(v for k, v in process_terms(*with_plan(padded), QWEN05_SHAPE, {"actor"}).items()
                       if k.startswith("activations"))
    assert activations == 8704 * 24 * (10 * 896 + 4 * 4864 + 2 * 14 * 8704) * 2
    # a row of odd length: 8,705 tokens pad to 8,706, 4,353 a rank
    odd = compose([*base, "data.max_prompt_tokens=513", "actor.sequence_parallel_size=2"])
    assert any("4353 tokens" in k for k in process_terms(*with_plan(odd), QWEN05_SHAPE, {"actor"}))


def test_a_pool_is_priced_at_the_smallest_sequence_parallel_size_of_its_roles():
    """The roles on a pool take turns; the micro-batch split the least is the largest: a critic at SP 1 beside an
    actor at SP 2 keeps SP 1's activations on the pool; at SP 2 both, half. On a GPU the training phase too."""
    from hybridflow.checks.memory_budget import MemoryInputs, device_terms, pool_sequence_parallel

    inputs = MemoryInputs(shape=QWEN05_SHAPE, compute_bytes=2, master_bytes=4, rollout_bytes=2, rows=1,
                          prompt_tokens=512, response_tokens=8192, checkpointing=False, kv_cache_bytes=GIB, actor_sp=2)
    assert pool_sequence_parallel(inputs, {"actor", "reference", "rollout"}) == 2
    assert pool_sequence_parallel(inputs, {"actor", "critic"}) == 1
    assert pool_sequence_parallel(dataclasses.replace(inputs, critic_sp=2), {"actor", "critic"}) == 2
    assert pool_sequence_parallel(dataclasses.replace(inputs, reward_parameters=10), {"actor", "reward"}) == 1

    def activations(inputs, roles, device):
        return next(v for k, v in device_terms(inputs, roles, 2, 1, device).items() if k.startswith("activations"))
    for device in ("cpu", "cuda"):
        whole = activations(inputs, {"critic"}, device)
        assert activations(inputs, {"actor"}, device) == whole / 2
        assert activations(inputs, {"actor", "critic"}, device) == whole


def test_a_sequence_too_long_for_one_gpu_is_refused_naming_the_sequence_parallel_size_that_fits(tmp_path,
                                                                                                 tiny_model_dir):
    """Qwen2.5-0.5B on 2 GPUs of 24 GiB (21.6 usable), one checkpointed row of 512 + 32,768 tokens: the fixed
    terms 4.95 GiB (0.92 + 0.92 + 1.84 of float32 state, 0.51 of gathered embeddings, 0.75 of context and
    NCCL), activations 33,280 x (896 x 24 + 28,416 floats) x 2 B = 3.09 GiB and logits 2 x 32,768 x 151,936 x
    2 B = 18.55 GiB: 26.6 GiB. At SP 2 (14 heads and 2 key/value heads admit 1 and 2): 16,640 tokens a rank,
    1.55 GiB of activations and 9.42 of logits: 15.9 GiB, fits. At 512 + 131,072 even SP 2 does not."""
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", *GPU[2:5], "placement.pools.global.devices_per_node=2",
            "actor.samples_per_micro_batch=1", "actor.gradient_checkpointing=true", "data.max_prompt_tokens=512",
            "rollout.backend=hf", "rollout.max_num_seqs=1"]
    refused = memory_problems(*with_plan(compose([*base, "rollout.max_response_tokens=32768"])), gpu_bytes=24 * GIB)
    training = [p for p in refused if "while it trains" in p]
    assert len(training) == 1, refused
    text = training[0]
    assert "26.58 GiB" in text and "18.55 GiB  its logits" in text, text
    assert ("data.max_prompt_tokens + rollout.max_response_tokens = 33280 tokens, is whole on one rank "
            "(actor.sequence_parallel_size=1)") in text
    assert "split it further: actor.sequence_parallel_size=2 (each rank then holds 1/2" in text
    assert "the sizes the heads and the pool admit: [2]" in text
    fixed = memory_problems(*with_plan(compose([*base, "rollout.max_response_tokens=32768",
                                                "actor.sequence_parallel_size=2"])), gpu_bytes=24 * GIB)
    assert not any("while it trains" in p for p in fixed), fixed
    hopeless = memory_problems(*with_plan(compose([*base, "rollout.max_response_tokens=131072"])), gpu_bytes=24 * GIB)
    assert any("no sequence_parallel_size the heads and the pool admit ([2]) fits either" in p for p in hopeless)


def test_a_sequence_too_long_for_a_cpu_node_is_refused_naming_the_sequence_parallel_size(tmp_path, tiny_model_dir):
    """The CPU's check says the same: Qwen2.5-0.5B, 2 processes, one checkpointed row of 512 + 16,384 tokens on a
    64 GiB node (60.8 usable): eager attention's probabilities (2 x 14 x 16,896 floats per token) make one rank's
    activations 16.5 GiB and its logits 9.3 at SP 1, 33.6 GiB a process, 67 a node; at SP 2 each rank holds 8,448
    tokens (8.2 GiB, logits 4.9): 41 GiB a node, it fits."""
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", "placement.device=cpu", *PINNED, "data.max_prompt_tokens=512",
            "rollout.max_response_tokens=16384", "actor.samples_per_micro_batch=1", "actor.gradient_checkpointing=true"]
    refused = memory_problems(*with_plan(compose(base)), node_bytes=64 * GIB)
    assert len(refused) == 1 and "split it further: actor.sequence_parallel_size=2" in refused[0], refused
    assert memory_problems(*with_plan(compose([*base, "actor.sequence_parallel_size=2"])), node_bytes=64 * GIB) == []
