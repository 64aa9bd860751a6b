"""Training objectives: what an update asks of a batch, one small class each.

An objective says which columns it reads (`needs`), its loss on a micro-batch with its statistics
(`loss`), and how a step's batch is cut where that differs from the usual (`epochs`, `whole_batch`,
`mini_batches`, `split`); nothing else. The worker owns the model, the optimizer and the offload; the
one loop that runs any objective is the trained roles' (hybridflow.training.loop `TrainingLoopMixin`:
accumulation, the loss scale and its float16 retry, clipping, the scheduler, the reduction over ranks).
Adding an objective is one new file: a subclass of `Objective` with `needs` and `loss` (base.py), and its
entry in `OBJECTIVES` below, by which a recipe asks a worker for it (`ActorWorker.train_objective(batch,
name, params)`: no new worker method)."""

from hybridflow.registry import Registry
from hybridflow.training.objectives.base import Objective, Split, token_split
from hybridflow.training.objectives.distill import TopKDistillObjective
from hybridflow.training.objectives.policy import PolicyObjective
from hybridflow.training.objectives.preference import PreferenceObjective
from hybridflow.training.objectives.sft import SFTObjective
from hybridflow.training.objectives.value import ValueObjective

# The objectives a recipe names (`train_objective`): built as cls(**params) from the recipe's config.
OBJECTIVES: Registry[type] = Registry("training objective", signature="cls(**params) -> Objective")
OBJECTIVES.add("sft", SFTObjective)
OBJECTIVES.add("distill_topk", TopKDistillObjective)

__all__ = ["OBJECTIVES", "Objective", "PolicyObjective", "TopKDistillObjective", "PreferenceObjective", "SFTObjective", "Split", "ValueObjective",
           "token_split"]
