"""On-policy distillation's part of the PPO family's step (recipe=distill, or a teacher beside GRPO's or PPO's
reward; docs/distillation.md): the teachers' scores of a step's samples (`TeacherScores`: one teacher, or
several routed by a data column), the distillation signal added to the advantage (`add_distillation`), and
GKD's mixture of data answers into the batch (`with_data_answers`, `students`). recipes/ppo.py calls them."""

from __future__ import annotations

import torch

from hybridflow.algos import distillation_signal
from hybridflow.batch import Batch
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.data.answers import encode_answers
from hybridflow.training.sequences import pad_response_width


def add_distillation(samples: Batch, config: HybridFlowConfig, advantages: torch.Tensor, mask: torch.Tensor,
                     proximal: str, metrics: dict[str, float]) -> torch.Tensor:
    """teacher.reward_weight · the reward's advantage + teacher.kl_coef · the teacher's signal (teacher.signal,
    hybridflow.algos.distill) on the sampled tokens, the student's side read from the `proximal` log-probs
    (π_old, which the update's ratio starts from); its statistics as `distill/*` in `metrics`."""
    t = config.teacher
    signal, stats = distillation_signal(t.signal, teacher_log_probs=samples["teacher_log_probs"],
                                        student_log_probs=samples[proximal], response_mask=mask)
    metrics.update({f"distill/{k}": v for k, v in stats.items()})
    for name in t.teachers:  # several teachers: each one's statistics over its own prompts' samples
        rows = torch.tensor([value == name for value in samples[t.column]])
        if rows.any():
            _, own = distillation_signal(t.signal, teacher_log_probs=samples["teacher_log_probs"][rows],
                                         student_log_probs=samples[proximal][rows], response_mask=mask[rows])
            metrics.update({f"distill/{name}/{k}": v for k, v in own.items()})
            metrics[f"distill/{name}/samples"] = float(rows.sum())
    return t.reward_weight * advantages + t.kl_coef * signal


def with_data_answers(r, samples: Batch, step: int) -> Batch:
    """GKD's mixture (teacher.student_fraction < 1, TRL's `lmbda`): a fixed share of the step's samples, drawn
    from (seed, step) alone, get their prompt's data answer (`ground_truth`) as the response instead of the
    student's, with `from_data` True; the teacher then scores them as it scores a sample. Response columns
    are padded to a width both fit."""
    rows = round((1 - r.config.teacher.student_fraction) * len(samples))
    if rows == 0:
        return samples
    picked = torch.randperm(len(samples), generator=torch.Generator().manual_seed(r.config.seed * 100003 + step))[:rows]
    answers = [str(r.loader.rows[int(i)]["ground_truth"]) for i in samples["prompt_index"][picked]]
    encoded = encode_answers(answers, r.tokenizer, r.config.rollout.max_response_tokens)
    width = max(samples["response_ids"].shape[1], int(encoded["response_mask"].sum(dim=1).max()))
    tensors = {k: pad_response_width(v, width).clone() if k in RESPONSE_COLUMNS else v for k, v in samples.tensors.items()}
    tensors["response_ids"][picked] = encoded["response_ids"][:, :width]
    tensors["response_mask"][picked] = encoded["response_mask"][:, :width]
    if "loss_mask" in tensors:
        tensors["loss_mask"][picked] = encoded["response_mask"][:, :width]
    tensors["from_data"] = torch.zeros(len(samples), dtype=torch.bool)
    tensors["from_data"][picked] = True
    objects = dict(samples.objects)
    objects["response"] = list(objects["response"])
    for row, answer in zip(picked.tolist(), answers):
        objects["response"][row] = answer
    mixed = Batch(tensors=tensors, objects=objects, meta=dict(samples.meta))
    mixed.meta["distill/student_fraction"] = 1 - rows / len(samples)
    return mixed


class TeacherScores:
    """The teachers' scores of a step's samples, issued now, joined by `get`: one teacher scores every sample;
    several (teacher.teachers) each score the samples of the prompts whose data row names them in
    teacher.column, and their rows are put back in the batch's order."""

    def __init__(self, r, samples: Batch) -> None:
        t = r.config.teacher
        self.topk, self.k = t.objective == "topk", t.top_k
        if len(r.teachers) == 1:
            self.parts = [(None, self._ask(next(iter(r.teachers.values())), samples))]
            return
        names = samples[t.column]
        unknown = sorted({str(n) for n in names} - set(t.teachers))
        if unknown:
            first = next(i for i, n in enumerate(names) if str(n) not in t.teachers)
            raise ValueError(f"teacher.teachers routes each prompt by its data column {t.column!r}, and training row "
                             f"{int(samples['prompt_index'][first])} names {names[first]!r} (all unknown: {unknown}); "
                             f"the teachers are {sorted(t.teachers)}. Fix the data, or add those teachers")
        self.parts = []
        for name in t.teachers:
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], dtype=torch.long)
            if len(rows):
                self.parts.append((rows, self._ask(r.teachers[f"teacher.{name}"], samples.index(rows))))
        self.rows = len(samples)

    def _ask(self, teacher, samples: Batch):
        if self.topk:
            return teacher.compute_teacher_topk.remote(samples, self.k)
        return teacher.compute_teacher_log_probs.remote(samples)

    def get(self) -> Batch:
        if self.parts[0][0] is None:
            return self.parts[0][1].get()
        scored = [(rows, future.get()) for rows, future in self.parts]
        tensors = {}
        for key, first in scored[0][1].tensors.items():
            width = max(part.tensors[key].shape[1] for _, part in scored)
            out = first.new_zeros((self.rows, width, *first.shape[2:]))
            for rows, part in scored:
                out[rows] = pad_response_width(part.tensors[key], width)
            tensors[key] = out
        seconds = sum(part.meta.get("timing/teacher_forward_s", 0.0) for _, part in scored)
        return Batch(tensors=tensors, meta={"timing/teacher_forward_s": seconds})


# the (B, R) columns a step's samples carry from the rollout (hybridflow.batch_keys), padded together
RESPONSE_COLUMNS = ("response_ids", "response_mask", "loss_mask", "sampler_log_probs", "token_versions")


def students(samples: Batch) -> Batch:
    """The samples the student generated: all but the data answers a distillation mixed in (`from_data`)."""
    if "from_data" not in samples or not samples["from_data"].any():
        return samples
    return samples.index(torch.nonzero(~samples["from_data"])[:, 0])
