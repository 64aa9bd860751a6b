"""On-policy distillation's pieces, each as a run uses it: the signal against an independent float64
formula, the advantage the PPO-family step trains, and what is refused before start (no teacher, a
teacher of another tokenizer, a teacher that does not fit, a pipeline teacher that is not earlier).
The recipe itself learns in the slow tier's twin of recipe=distill_pipeline (tests/e2e/test_pipeline.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos import DISTILLATION_SIGNALS, distillation_signal
from hybridflow.batch import Batch
from hybridflow.config import ConfigError, compose
from hybridflow.config.teacher import DISTILLATION_SIGNAL_NAMES
from hybridflow.checks.memory_budget import GIB, memory_problems
from hybridflow.planning.plan import Plan
from recipes.ppo import add_advantages
from tests.unit.test_memory_budget import PINNED, header_only_model, qwen2_shapes


def _log_probs(rows: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log(torch.rand(rows, width, generator=generator, dtype=torch.float64).clamp(min=1e-6))


def test_reverse_kl_is_the_teachers_log_prob_minus_the_students_on_each_sampled_token():
    teacher, student = _log_probs(4, 6, 0), _log_probs(4, 6, 1)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 3:] = mask[3, 1:] = False
    signal, stats = distillation_signal("reverse_kl", teacher_log_probs=teacher.float(),
                                        student_log_probs=student.float(), response_mask=mask)
    expected = torch.where(mask, teacher - student, torch.zeros_like(teacher))  # float64
    assert torch.allclose(signal.double(), expected, rtol=0, atol=1e-6)
    kl = float(((student - teacher) * mask).sum() / mask.sum())  # the sampled estimate of KL(student || teacher)
    assert stats["reverse_kl"] == pytest.approx(kl, rel=1e-5)
    assert stats["teacher_log_prob_mean"] == pytest.approx(float((teacher * mask).sum() / mask.sum()), rel=1e-5)


def test_the_signal_registry_is_the_schema_s_list():
    assert sorted(DISTILLATION_SIGNALS.names()) == sorted(DISTILLATION_SIGNAL_NAMES)


def _scored(teacher: torch.Tensor, student: torch.Tensor, rewards: list[float]) -> Batch:
    rows, width = teacher.shape
    return Batch({"sequence_rewards": torch.tensor(rewards), "response_mask": torch.ones(rows, width, dtype=torch.bool),
                  "group_ids": torch.tensor([0, 0, 1, 1]), "sampler_log_probs": student.float(),
                  "teacher_log_probs": teacher.float(), "response_ids": torch.ones(rows, width, dtype=torch.long)})


@pytest.mark.parametrize("reward_weight", [0.0, 1.0])
def test_the_step_trains_the_weighed_reward_advantage_plus_the_weighed_signal(reward_weight):
    teacher, student = _log_probs(4, 5, 2), _log_probs(4, 5, 3)
    config = compose(["recipe=distill", "teacher.path=/t", f"teacher.reward_weight={reward_weight}",
                      "teacher.kl_coef=0.5", "trainer.old_log_probs=sampler", "rollout.samples_per_prompt=2"])
    samples, metrics = add_advantages(_scored(teacher, student, [1.0, 0.0, 0.0, 0.0]), config, kl_coef=0.0,
                                      proximal="sampler_log_probs")
    without = compose(["recipe=grpo", "trainer.old_log_probs=sampler", "rollout.samples_per_prompt=2"])
    plain, _ = add_advantages(_scored(teacher, student, [1.0, 0.0, 0.0, 0.0]).select(
        ["sequence_rewards", "response_mask", "group_ids", "sampler_log_probs", "response_ids"]), without, kl_coef=0.0,
        proximal="sampler_log_probs")
    expected = reward_weight * plain["advantages"].double() + 0.5 * (teacher - student)
    assert torch.allclose(samples["advantages"].double(), expected, atol=1e-6)
    assert metrics["distill/reverse_kl"] == pytest.approx(float((student - teacher).mean()), rel=1e-5)
    assert metrics["advantages/advantage_mean"] == pytest.approx(float(expected.mean()), rel=1e-4, abs=1e-6)


def test_recipe_distill_without_a_teacher_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"teacher\.path.*recipe=distill distils from a teacher"):
        compose(["recipe=distill"])


def test_a_signal_weight_of_zero_is_refused_with_the_way_to_run_without_a_teacher():
    with pytest.raises(ConfigError, match=r"teacher\.kl_coef=0\.0.*teacher\.path=null"):
        compose(["recipe=distill", "teacher.path=/t", "teacher.kl_coef=0"])


def test_a_teacher_is_started_only_by_a_recipe_that_reads_it():
    assert "teacher" in compose(["recipe=distill", "teacher.path=/t"]).model_roles
    assert "teacher" in compose(["recipe=grpo", "teacher.path=/t"]).model_roles  # distillation beside the reward
    assert "teacher" not in compose(["recipe=sft", "teacher.path=/t"]).model_roles


def test_a_teacher_of_another_tokenizer_is_refused_before_start_naming_both(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from hybridflow.builders import build_tiny_model
    from hybridflow.checks.preflight import check_run

    teacher = build_tiny_model(tmp_path / "teacher")
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<tool>"])  # one token more: every id past the vocabulary names nothing for the student
    tokenizer.save_pretrained(teacher)
    config = compose(["recipe=distill", f"model.path={tiny_model_dir}", f"teacher.path={teacher}"])
    problems = [p for p in check_run(config) if p.startswith("teacher.path")]
    assert len(problems) == 1, check_run(config)
    assert "is not the student's" in problems[0] and str(tiny_model_dir) in problems[0] and "'<tool>'" in problems[0]
    same = compose(["recipe=distill", f"model.path={tiny_model_dir}", f"teacher.path={tiny_model_dir}"])
    assert not [p for p in check_run(same) if p.startswith("teacher.path")]


def test_a_teacher_that_does_not_fit_is_refused_with_its_term(tmp_path, tiny_model_dir):
    student = header_only_model(tmp_path / "qwen05", tiny_model_dir)
    # a 7B-shaped teacher (Qwen2.5-7B's shapes): 7.6B parameters, 14 GiB per process in float32 over 2 ranks
    seven = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}
    teacher = header_only_model(tmp_path / "teacher7b", tiny_model_dir, config=seven,
                                shapes=qwen2_shapes(3584, 18944, 152064, 4 * 128, 28, tied=False))
    base = ["recipe=distill", "model=local_hf", f"model.path={student}", "placement.device=cpu", *PINNED]
    fits = compose([*base, f"teacher.path={student}"])
    assert memory_problems(fits, Plan.from_config(fits), node_bytes=24 * GIB) == []
    big = compose([*base, f"teacher.path={teacher}"])
    refused = memory_problems(big, Plan.from_config(big), node_bytes=24 * GIB)
    assert len(refused) == 1 and "teacher weights (teacher.dtype, FSDP shard)" in refused[0], refused


def test_a_pipeline_teacher_must_be_an_earlier_stage():
    stages = ("pipeline.stages=[{name: a, recipe: grpo}, {name: b, recipe: distill, teacher_stage: %s}]")
    with pytest.raises(ConfigError, match=r"teacher_stage.*an earlier stage.*\['a'\]"):
        compose(["recipe=pipeline", stages % "b"])
    with pytest.raises(ConfigError, match=r"recipe=sft has no teacher"):
        compose(["recipe=pipeline", "pipeline.stages=[{name: a, recipe: grpo}, {name: b, recipe: sft, teacher_stage: a}]"])


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, float64, from probabilities."""
    return (p * (p.log() - q.log())).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_top_k_divergence_is_gkd_s_generalised_jsd_over_the_renormalised_top_k(beta):
    """Against the paper's definition in float64 (Agarwal et al. 2024, eq. 1, in TRL's convention for beta:
    0 the forward KL(teacher || student), 1 the reverse KL(student || teacher))."""
    from hybridflow.algos import topk_divergence

    generator = torch.Generator().manual_seed(4)
    student_at_k = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64).log_softmax(-1) - 1.5  # not normalised
    teacher_at_k = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64).log_softmax(-1) - 0.5
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False
    got = topk_divergence(student_log_probs_at_topk=student_at_k.float(), teacher_topk_log_probs=teacher_at_k.float(),
                          response_mask=mask, beta=beta)
    p_s, p_t = student_at_k.exp(), teacher_at_k.exp()
    p_s, p_t = p_s / p_s.sum(-1, keepdim=True), p_t / p_t.sum(-1, keepdim=True)  # renormalised over the k tokens
    m = beta * p_t + (1 - beta) * p_s
    want = {0.0: _kl(p_t, p_s), 1.0: _kl(p_s, p_t)}.get(beta, beta * _kl(p_t, m) + (1 - beta) * _kl(p_s, m))
    assert torch.allclose(got.double(), want * mask, atol=1e-6)
    assert (got[~mask] == 0).all() and (got[mask] > 0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_a_student_that_is_its_teacher_has_no_top_k_divergence(tiny_model_dir, packed):
    """The teacher's top-k (workers/teacher.py's pass) and the student's log-probs at those ids (the objective's)
    read the same positions, packed or padded: the model against itself gives the same numbers, divergence 0."""
    from transformers import AutoModelForCausalLM

    from hybridflow.algos import topk_divergence
    from hybridflow.training.packing import choose_packing
    from hybridflow.training.sequences import response_log_probs_at, response_topk
    from tests.unit.test_gradient_splits import _batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    assert choose_packing(model, packed) == packed
    batch = _batch(tiny_model_dir)
    ids, teacher = response_topk(model, batch, k=4, temperature=0.7)
    with torch.no_grad():
        student = response_log_probs_at(model, batch, ids, temperature=0.7)
    mask = batch["response_mask"]
    assert torch.allclose(student[mask], teacher[mask], atol=1e-5)
    assert (teacher[mask][:, :-1] >= teacher[mask][:, 1:]).all()  # the likeliest first
    divergence = topk_divergence(student_log_probs_at_topk=student, teacher_topk_log_probs=teacher, response_mask=mask,
                                 beta=0.5)
    assert divergence.abs().max() < 1e-6


def test_topk_with_a_reward_or_stale_batches_and_data_answers_without_topk_are_refused():
    with pytest.raises(ConfigError, match=r"teacher\.student_fraction=0\.5.*no sampler log-probs"):
        compose(["recipe=distill", "teacher.path=/t", "teacher.student_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"teacher\.reward_weight=1\.0.*trains the divergence alone"):
        compose(["recipe=grpo", "teacher.path=/t", "teacher.objective=topk"])
    with pytest.raises(ConfigError, match=r"teacher\.objective='topk'.*trainer\.max_staleness=1"):
        compose(["recipe=distill", "teacher.path=/t", "teacher.objective=topk", "trainer.max_staleness=1", "trainer.old_log_probs=sampler",
                 "placement=disaggregated"])
    with pytest.raises(ConfigError, match=r"teacher\.student_fraction=0\.5.*agent trajectories"):
        compose(["recipe=distill", "teacher.path=/t", "teacher.objective=topk", "teacher.student_fraction=0.5",
                 "rollout.agent=[hybridflow.data.calculator:calc]"])


def test_gkd_s_mixture_gives_a_fixed_share_of_the_samples_their_data_answer(tiny_model_dir):
    """teacher.student_fraction=0.75 (TRL's lmbda): a quarter of the step's samples, drawn from (seed, step)
    alone, carry their prompt's ground_truth as the response (tokens, mask, text), flagged `from_data`; the
    columns are padded to a width both fit; the step's reward metrics read the student's samples only."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from recipes.distillation import students, with_data_answers

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = compose(["recipe=distill", "teacher.path=/t", "teacher.objective=topk", "teacher.student_fraction=0.75"])
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(1000 + i)} for i in range(8)]
    r = SimpleNamespace(config=config, loader=SimpleNamespace(rows=rows), tokenizer=tokenizer)
    samples = Batch(tensors={"prompt_index": torch.arange(8), "response_ids": torch.full((8, 2), 7),
                             "response_mask": torch.ones(8, 2, dtype=torch.bool), "sampler_log_probs": -torch.ones(8, 2),
                             "sequence_rewards": torch.zeros(8)},
                    objects={"response": ["xy"] * 8})
    mixed = with_data_answers(r, samples, step=3)
    picked = torch.nonzero(mixed["from_data"])[:, 0].tolist()
    assert len(picked) == 2 and picked == torch.nonzero(with_data_answers(r, samples, step=3)["from_data"])[:, 0].tolist()
    assert picked != torch.nonzero(with_data_answers(r, samples, step=4)["from_data"])[:, 0].tolist()
    assert mixed["response_ids"].shape[1] == 5  # four digits and EOS
    for row in picked:
        tokens = tokenizer(str(1000 + row), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert mixed["response_ids"][row, :5].tolist() == tokens and mixed["response_mask"][row].all()
        assert mixed["response"][row] == str(1000 + row)
    kept = [i for i in range(8) if i not in picked]
    assert mixed["response_ids"][kept, :2].eq(7).all() and not mixed["response_mask"][kept, 2:].any()
    assert samples["response_ids"].shape == (8, 2)  # the generated batch itself is left as it was
    assert students(mixed)["prompt_index"].tolist() == kept


class _Teacher:
    """A teacher group's stand-in for the routing test: scores each sample with its own constant, and records
    which prompts it was asked about."""

    def __init__(self, value: float) -> None:
        self.value, self.asked = value, []
        self.compute_teacher_log_probs = self

    def remote(self, samples: Batch):
        self.asked.append(samples["prompt_index"].tolist())
        scores = Batch({"teacher_log_probs": torch.full(samples["response_ids"].shape, self.value)},
                       meta={"timing/teacher_forward_s": 1.0})
        return type("Done", (), {"get": lambda _: scores})()


def test_several_teachers_each_score_the_prompts_their_column_names_and_the_rows_come_back_in_order():
    from types import SimpleNamespace

    from recipes.distillation import TeacherScores

    config = compose(["recipe=distill", "+teacher.teachers={math: /m, code: /c}", "teacher.column=domain"])
    math, code = _Teacher(-1.0), _Teacher(-2.0)
    r = SimpleNamespace(config=config, teachers={"teacher.math": math, "teacher.code": code})
    samples = Batch(tensors={"prompt_index": torch.arange(5), "response_ids": torch.zeros(5, 3, dtype=torch.long)},
                    objects={"domain": ["code", "math", "math", "code", "math"]})
    scored = TeacherScores(r, samples).get()
    assert math.asked == [[1, 2, 4]] and code.asked == [[0, 3]]
    assert scored["teacher_log_probs"][:, 0].tolist() == [-2.0, -1.0, -1.0, -2.0, -1.0]
    assert scored.meta["timing/teacher_forward_s"] == 2.0
    samples.objects["domain"][3] = "law"
    with pytest.raises(ValueError, match=r"training row 3 names 'law'.*\['code', 'math'\]"):
        TeacherScores(r, samples)


def test_several_teachers_need_their_column_in_the_training_data_before_start(tiny_model_dir):
    from hybridflow.checks.preflight import check_run

    config = compose(["recipe=distill", f"model.path={tiny_model_dir}",
                      f"+teacher.teachers={{math: {tiny_model_dir}, code: {tiny_model_dir}}}"])
    problems = check_run(config)
    assert any("no column 'teacher'" in p and "teacher.teachers routes each training prompt" in p for p in problems), problems
    with pytest.raises(ConfigError, match="not both"):
        compose(["recipe=distill", "teacher.path=/t", "+teacher.teachers={a: /a}"])
