"""placement=auto and `hybridflow plan` choosing Ulysses sequence parallelism (hybridflow/planning/auto.py
`split_sequences`, docs/long_sequences.md "Memory"): where no plan fits at the configured sizes, the smallest
larger size the heads admit at which one fits is the size the stage runs with, said once and recorded in
plan.json; a size that fits is kept; without placement=auto the run is refused naming that size, as before."""

from __future__ import annotations

import json

import pytest

from hybridflow.checks.memory_budget import NODE_MEMORY_SHARE, memory_problems
from hybridflow.data.checks import InputError
from hybridflow.planning.cli import main as plan_main
from hybridflow.planning.cost import Rates
from hybridflow.planning.workload import GIB, Cluster
from hybridflow.run.pipeline_stages import compose_command
from hybridflow.run.stage import prepare_stage
from tests.unit.test_memory_budget import PINNED, header_only_model

ONES = Rates(train_flops_per_s=1e9, forward_flops_per_s=2e9, decode_bytes_per_s=1e9, decode_flops_per_s=1e18,
             decode_step_s=0.01, tp_step_s=0.001, call_s=0.1, intra_node_bytes_per_s=1e8,
             inter_node_bytes_per_s=1e7, sync_s=0.2, source="test")
# The tiny model (4 attention heads, 2 key/value heads: SP 2 is the one size above 1 they admit), GRPO, one packed
# row of 64 + RESPONSE tokens a micro-batch, on 2 CPU slots of 3.6 GiB
TINY = ["recipe=grpo", "model.tiny.max_position_embeddings=131072", "data.max_prompt_tokens=64",
        "actor.samples_per_micro_batch=1", "actor.gradient_checkpointing=false", "model.pack_sequences=true"]
TWO_SLOTS = Cluster(1, 2, 3.6 * GIB)
LINE = ("hybridflow: placement=auto chose actor.sequence_parallel_size=2 (configured: actor.sequence_parallel_size=1): "
        "with the longest sequence (data.max_prompt_tokens + rollout.max_response_tokens = 65600 tokens) a rank of "
        "pool 'actor' peaks at 5.08 GiB at the configured size, above the 3.60 GiB a rank may use, and at 3.45 GiB "
        "split over 2 ranks (the smallest size the heads admit, of [2], at which a plan fits; docs/long_sequences.md)")


@pytest.fixture
def auto(tmp_path, monkeypatch):
    """The overrides of a placement=auto run on `cluster` (this machine's, as the planner reads it) with fixed rates."""
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(ONES.to_dict()))

    def overrides(cluster: Cluster = TWO_SLOTS) -> list[str]:
        monkeypatch.setattr(Cluster, "this_machine", classmethod(lambda cls, device="cpu": cluster))
        return ["placement=auto", f"placement.planner.rates={rates}"]
    return overrides


def test_placement_auto_runs_a_sequence_no_plan_fits_at_sp_1_at_sp_2(tmp_path, auto):
    """65,536-token responses. At SP 1 the colocated pool's rank holds 1.75 GiB of runtime and KV cache, 0.01 of
    state, the activations of 65,600 tokens x 4 layers x (10 x 128 + 4 x 512 = 3,328 floats) x 4 B = 3.25 GiB
    and logits 2 x 65,536 x 128 x 4 B = 0.06: 5.08 GiB, above 3.6; the actor alone on one slot (0.5 GiB of
    runtime) 3.83: no plan fits. At SP 2 (two slots only together) each rank holds 32,800 tokens: 1.63 GiB of
    activations, 0.03 of logits, 0.03 of all-to-all buffers: 3.45 GiB, fits."""
    stage = prepare_stage(compose_command([*TINY, "rollout.max_response_tokens=65536", *auto()]))
    assert stage.config.actor.sequence_parallel_size == 2  # what the recipe and the role specs are built from
    assert stage.config.critic.sequence_parallel_size == 1  # GRPO has no critic: its key is not raised
    assert stage.plan.devices_of("actor") == 2
    assert [line for line in stage.said if "sequence_parallel_size" in line] == [LINE]
    stage.save(tmp_path)
    record = json.loads((tmp_path / "plan.json").read_text())["sequence_parallel"]
    assert record["chosen"] == {"actor.sequence_parallel_size": 2}
    assert record["configured"] == {"actor.sequence_parallel_size": 1} and record["admitted"] == [2]
    assert record["longest_sequence_tokens"] == 65600 and record["limit_gib"] == pytest.approx(3.6)
    assert record["peak_configured_gib"] == pytest.approx(5.075, abs=1e-3)
    assert record["peak_chosen_gib"] == pytest.approx(3.450, abs=1e-3)


def test_placement_auto_keeps_a_size_that_fits(auto):
    """Where a plan fits at the configured sizes nothing is raised: 16,384-token responses at SP 1 (the actor
    alone on a slot: 1.35 GiB), and a configured SP 2 at 65,536 tokens (the size the run above is raised to)."""
    fits = prepare_stage(compose_command([*TINY, "rollout.max_response_tokens=16384", *auto()]))
    assert fits.config.actor.sequence_parallel_size == 1
    assert not any("sequence_parallel_size" in line for line in fits.said)
    assert "sequence_parallel" not in fits.record
    configured = prepare_stage(compose_command([*TINY, "rollout.max_response_tokens=65536",
                                                "actor.sequence_parallel_size=2", *auto()]))
    assert configured.config.actor.sequence_parallel_size == 2 and "sequence_parallel" not in configured.record
    assert not any("sequence_parallel_size" in line for line in configured.said)
    raised = prepare_stage(compose_command([*TINY, "rollout.max_response_tokens=65536", *auto()]))
    assert raised.config.actor.sequence_parallel_size == 2 and raised.record["sequence_parallel"]


def test_placement_auto_refuses_a_sequence_no_size_fits(auto):
    """120,000-token responses: even at SP 2 a rank holds 2.98 GiB of activations beside 1.75 of runtime and KV
    cache: no plan fits at any size the heads admit, and the refusal lists the memory terms and says so."""
    with pytest.raises(InputError) as refused:
        prepare_stage(compose_command([*TINY, "rollout.max_response_tokens=120000", *auto()]))
    text = str(refused.value)
    assert "placement=auto on 1 node(s) x 2 cpu device(s)" in text and "no plan fits" in text
    assert "GiB  activations of one micro-batch (1 rows x 120064 tokens" in text
    assert text.endswith("Nor with more sequence parallelism: actor.sequence_parallel_size was searched at each size "
                         "above the configured one that the heads admit ([2]), and no plan fits at any")


def test_without_placement_auto_the_size_is_named_not_chosen(tmp_path, tiny_model_dir, auto):
    """Qwen2.5-0.5B's shapes, one checkpointed row of 512 + 16,384 tokens on 2 CPU processes of a 64 GiB node
    (test_memory_budget.py's CPU case): without placement=auto the stage keeps SP 1 and the preflight refuses
    it naming actor.sequence_parallel_size=2; with placement=auto on the same node the stage runs at SP 2."""
    model = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    base = ["model=local_hf", f"model.path={model}", "placement.device=cpu", *PINNED, "data.max_prompt_tokens=512",
            "rollout.max_response_tokens=16384", "actor.samples_per_micro_batch=1", "actor.gradient_checkpointing=true"]
    own = prepare_stage(compose_command(base))
    assert own.config.actor.sequence_parallel_size == 1
    assert not any("sequence_parallel_size" in line for line in own.said)
    refused = memory_problems(own.config, own.plan, node_bytes=64 * GIB)
    assert len(refused) == 1 and "split it further: actor.sequence_parallel_size=2" in refused[0], refused
    chosen = prepare_stage(compose_command([*base, *auto(Cluster(1, 2, NODE_MEMORY_SHARE * 64 * GIB / 2))]))
    assert chosen.config.actor.sequence_parallel_size == 2
    assert any(line.startswith("hybridflow: placement=auto chose actor.sequence_parallel_size=2") for line in chosen.said)


def test_the_plan_command_shows_the_size_it_plans_with(tmp_path, capsys):
    """`hybridflow plan` plans as placement=auto runs: the run above, on the same two slots, is ranked at SP 2,
    said first, and each pool's memory line and the --json file carry it."""
    saved = tmp_path / "plan.json"
    argv = ["--cluster", "1x2", "--device-memory-gib", "3.6", "--depths", "0", "--json", str(saved), *TINY]
    assert plan_main([*argv, "rollout.max_response_tokens=65536"], compose_command) == 0
    out = capsys.readouterr().out
    assert out.startswith(LINE.replace("hybridflow: placement=auto", "hybridflow plan:"))
    assert "sequence parallel actor 2" in out and "(actor+rollout on 2, sequence parallel: actor 2)" in out
    assert json.loads(saved.read_text())["sequence_parallel"]["chosen"] == {"actor.sequence_parallel_size": 2}
    assert plan_main([*argv, "rollout.max_response_tokens=120000"], compose_command) == 2
    assert "Nor with more sequence parallelism" in capsys.readouterr().out
