"""The `teacher.*` config schema: on-policy distillation (recipe=distill, or a distillation term beside
GRPO's or PPO's reward). Plain dataclasses, importable without torch. The teacher is a frozen model of
its own (a Hugging Face directory) that scores the student's own samples; the signal it gives is
hybridflow/algos/distill.py's; docs/distillation.md is the guide."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Optional


def _require(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


# The built-in signals of hybridflow.algos.distill.DISTILLATION_SIGNALS (a test keeps the two the same;
# the schema names them without importing torch).
DISTILLATION_SIGNAL_NAMES = ("reverse_kl",)
TEACHER_DTYPES = ("float32", "bfloat16", "float16")
# How the teacher teaches: `advantage` (its per-token signal added to the advantage, trained by the policy
# loss) or `topk` (the student's distribution pulled toward the teacher's over its top-k tokens by GKD's
# generalised JSD: hybridflow/training/objectives/distill.py)
TEACHER_OBJECTIVES = ("advantage", "topk")


@dataclass
class TeacherConfig:
    # The teacher: a Hugging Face model directory whose tokenizer is the student's (refused before start
    # otherwise). null: no teacher. In a pipeline, a stage's `teacher_stage` sets it to an earlier
    # stage's final model.
    path: Optional[str] = None
    # Several teachers, by name: each a model directory with the student's tokenizer, each its own role
    # (`teacher.<name>`, on placement.roles.teacher's pool), each scoring the samples of the prompts whose
    # data row names it in `column`; metrics per teacher (distill/<name>/*). Exclusive with `path`.
    # From the command line: `+teacher.teachers={math: /models/math, code: /models/code}` (new entries take `+`).
    teachers: Dict[str, str] = field(default_factory=dict)
    column: str = "teacher"  # with `teachers`: the training data's column naming each prompt's teacher
    # The dtype the teacher computes in (frozen: no master copy); null: model.dtype
    dtype: Optional[str] = None
    # The per-token distillation signal (hybridflow.algos.distill): reverse_kl, the on-policy distillation
    # of Agarwal et al. (GKD) / Qwen3 / the Thinking Machines post: advantage_t = log pi_teacher(y_t) -
    # log pi_student(y_t) on the student's own sampled tokens, undiscounted, through the policy loss (its
    # ratio and clipping keep stale samples corrected)
    signal: str = "reverse_kl"
    # advantage: `signal` times kl_coef joins the advantage (recipe=distill's default); topk: the student's
    # distribution at each sampled position pulled toward the teacher's, both renormalised over the teacher's
    # top_k tokens, by GKD's generalised JSD with `beta` (TRL's GKDTrainer loss over the top k), one
    # supervised step per batch instead of the policy update (teacher.reward_weight must be 0)
    objective: str = "advantage"
    top_k: int = 16  # topk: the teacher's tokens per position the divergence is taken over
    # topk: GKD's beta in TRL's convention: 0 the forward KL(teacher || student), 1 the reverse
    # KL(student || teacher), between them the generalised JSD (TRL's GKDConfig default 0.5)
    beta: float = 0.5
    # topk: the fraction of each step's samples that are the student's own (TRL's GKD `lmbda`); the rest are
    # the same prompts' data answers (the `ground_truth` column), which the teacher scores as it scores a
    # sample. 1: on-policy only; 0: every response the data's (supervised distillation)
    student_fraction: float = 1.0
    # The weight of the distillation signal in each token's advantage
    kl_coef: float = 1.0
    # The weight of the reward's advantage (algorithm.advantage_estimator's) beside it: 1 adds distillation
    # to GRPO's or PPO's reward; recipe=distill sets 0 (the teacher alone; the reward is still scored and
    # logged, and validation's held-out accuracy still reads it)
    reward_weight: float = 1.0
    # Ulysses sequence parallelism for the teacher's scoring forward, as actor.sequence_parallel_size over the
    # teacher's ranks (docs/long_sequences.md); must divide its ranks and the teacher model's attention and
    # key/value heads
    sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.sequence_parallel_size >= 1, "teacher.sequence_parallel_size", self.sequence_parallel_size,
                 "must be >= 1 (1: every rank computes whole sequences)")
        self.teachers = dict(self.teachers)
        _require(not (self.path and self.teachers), "teacher.teachers", dict(self.teachers),
                 "give one teacher as teacher.path or several as teacher.teachers, not both")
        bad = [name for name in self.teachers if not re.fullmatch(r"[A-Za-z0-9_\-]+", str(name))]
        _require(not bad, "teacher.teachers", dict(self.teachers),
                 f"names {bad} must be letters, digits, '_' or '-' (each becomes the role teacher.<name>)")
        _require(self.signal in DISTILLATION_SIGNAL_NAMES, "teacher.signal", self.signal,
                 f"one of {list(DISTILLATION_SIGNAL_NAMES)}")
        _require(self.dtype is None or self.dtype in TEACHER_DTYPES, "teacher.dtype", self.dtype,
                 f"one of {list(TEACHER_DTYPES)}, or null for model.dtype")
        _require(self.kl_coef > 0, "teacher.kl_coef", self.kl_coef,
                 "must be > 0 (the distillation signal's weight); to train without a teacher, set teacher.path=null")
        _require(self.reward_weight >= 0, "teacher.reward_weight", self.reward_weight,
                 "must be >= 0 (0: the teacher's signal alone)")
        _require(self.objective in TEACHER_OBJECTIVES, "teacher.objective", self.objective,
                 f"one of {list(TEACHER_OBJECTIVES)}")
        _require(self.top_k >= 1, "teacher.top_k", self.top_k, "must be >= 1 (tokens per position)")
        _require(0.0 <= self.beta <= 1.0, "teacher.beta", self.beta,
                 "must be in [0, 1] (0: forward KL, 1: reverse KL, between: generalised JSD)")
        _require(0.0 <= self.student_fraction <= 1.0, "teacher.student_fraction", self.student_fraction,
                 "must be in [0, 1] (the student's share of each step's samples; the rest the data's answers)")
        _require(self.student_fraction == 1.0 or self.objective == "topk", "teacher.student_fraction",
                 self.student_fraction, "data answers have no sampler log-probs for the policy loss's ratio: mix them "
                 "in with teacher.objective=topk, or keep teacher.student_fraction=1")
        _require(self.objective != "topk" or self.reward_weight == 0, "teacher.reward_weight", self.reward_weight,
                 "teacher.objective=topk trains the divergence alone, with no advantage to weigh a reward in: set "
                 "teacher.reward_weight=0, or teacher.objective=advantage to add the teacher's signal to a reward")

    @property
    def runs(self) -> bool:
        return self.path is not None or bool(self.teachers)

    @property
    def paths(self) -> dict[str, str]:
        """Every teacher's model directory by role: {"teacher": path}, or {"teacher.<name>": path, ...}."""
        if self.teachers:
            return {f"teacher.{name}": path for name, path in self.teachers.items()}
        return {"teacher": self.path} if self.path is not None else {}
