"""A training state saved by N ranks resumes on M (2 -> 1 and 1 -> 2), without Ray.

Real processes (gloo) run the real ActorWorker and its TrainingStateMixin: FSDP2 on two ranks,
the plain module on one (as `shard_model` does for one CPU rank). Every step trains on a global
batch that depends only on the step, split over the ranks as the controller's DP dispatch
splits it, so the update is the same on any rank count up to float32 rounding (the actor
normalises by the global token count). A run trains 2 SFT steps and saves; fresh processes on
the same and on the other rank count load it and train step 3. The other-count resume must
give the same-count resume's loss, gradient norm, learning rate, update count and weights.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

WORLDS = (1, 2)
ROWS_PER_STEP = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_batch(model_dir: str, step: int):
    """The global batch of `step`: prompts and answers of arithmetic rows drawn from the step alone."""
    from transformers import AutoTokenizer

    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.answers import encode_answers
    from hybridflow.data.prompts import encode_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_arithmetic_rows(ROWS_PER_STEP, ArithmeticSpec(), seed=100 + step)
    return encode_prompts(rows, tokenizer, 16).union(encode_answers([r["ground_truth"] for r in rows], tokenizer, 8))


def _actor(model_dir: str, rank: int, world: int):
    from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig, TrainerConfig
    from hybridflow.controller import WorkerContext
    from recipes.roles import actor_role
    from hybridflow.run.stage import prepare_stage

    config = HybridFlowConfig(actor=ActorConfig(samples_per_micro_batch=1, optim=OptimConfig(
        lr=1e-2, warmup_steps=2, lr_schedule="cosine")), trainer=TrainerConfig(total_steps=10))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(rank=rank, world_size=world))
    actor.start()
    return actor


def _train_step(actor, model_dir: str, step: int, rank: int, world: int) -> dict:
    return actor.train_sft(_step_batch(model_dir, step).chunk(world)[rank])


def _run(rank: int, world: int, port: int, model_dir: str, phase: str, ckpt_dir: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hybridflow.checkpoint import capture_rng_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(1000 + rank)  # a resumed rank's RNG must come from the checkpoint, not from here
        actor = _actor(model_dir, rank, world)
        out: dict = {}
        if phase == "train":
            out["metrics"] = [_train_step(actor, model_dir, step, rank, world) for step in (1, 2)]
            actor.save_checkpoint(ckpt_dir)
        else:
            actor.load_checkpoint(ckpt_dir)
            out["rng_after_load"] = capture_rng_state()
            out["updates_after_load"] = actor.updates
            out["metrics"] = [_train_step(actor, model_dir, 3, rank, world)]
        out["params"] = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
        if rank == 0:
            torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, *args) -> None:
    """`world` processes of their own, forked from the test process's forkserver (tests/ranks.py)."""
    from tests.ranks import start_ranks

    start_ranks(_run, (world, _free_port(), *args), world, [__name__])


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """A 2-step run saved on each rank count, then each checkpoint resumed on each rank count."""
    root = tmp_path_factory.mktemp("rank_count")
    model_dir = str(tiny_model_dir)
    out = {}
    for saved in WORLDS:
        _spawn(saved, model_dir, "train", str(root / f"saved{saved}"), str(root / f"train{saved}.pt"))
        out[("train", saved)] = torch.load(root / f"train{saved}.pt", weights_only=False)
        for world in WORLDS:
            file = root / f"resume{saved}on{world}.pt"
            _spawn(world, model_dir, "resume", str(root / f"saved{saved}"), str(file))
            out[(saved, world)] = torch.load(file, weights_only=False)
    return root, out


def _assert_same_step(got: dict, want: dict) -> None:
    for key in ("actor/loss", "actor/grad_norm", "actor/lr"):
        assert got["metrics"][-1][key] == pytest.approx(want["metrics"][-1][key], rel=1e-5, abs=1e-7), key
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        # A key projection's bias adds the same q.b to every score of a query, which softmax cancels: its
        # gradient is 0 in exact arithmetic and rounding noise in float32, which AdamW normalises into
        # steps of up to a fraction of the lr. Any change of summation order (another rank count's
        # micro-batches, packed attention's layout) moves it by ~1e-6 (measured 2e-6 at lr 1e-2) where
        # every other weight agrees to 1.2e-7, so it gets the noise's scale, not float32's.
        atol = 1e-4 if name.endswith("k_proj.bias") else 1e-6
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("saved, world", [(2, 1), (1, 2)])
def test_resume_on_another_rank_count_matches_the_same_count_resume(runs, saved, world):
    _, out = runs
    same, other = out[(saved, saved)], out[(saved, world)]
    assert other["updates_after_load"] == same["updates_after_load"] == 2
    _assert_same_step(other, same)
    before = out[("train", saved)]["params"]
    assert all(not torch.equal(other["params"][n], before[n]) for n in before)  # step 3 trained every weight


def test_training_is_the_same_on_either_rank_count_so_the_comparison_means_something(runs):
    _, out = runs
    for step in (0, 1):
        one, two = out[("train", 1)]["metrics"][step], out[("train", 2)]["metrics"][step]
        assert one["actor/loss"] == pytest.approx(two["actor/loss"], rel=1e-5), step


def test_rng_rank0_takes_saved_rank0s_state(runs):
    root, out = runs
    for saved, world in [(2, 1), (1, 2)]:
        expected = torch.load(root / f"saved{saved}" / "rng_rank0.pt", weights_only=True)
        assert out[(saved, world)]["rng_after_load"] == expected


def test_a_new_rank_is_seeded_from_saved_rank0_and_its_rank(tiny_model_dir, runs):
    """Rank 1 of a 1 -> 2 resume: the documented derivation, the same on every resume."""
    from hybridflow.checkpoint.rng import capture_rng_state, derived_seed, seed_rng

    root, _ = runs
    saved0 = torch.load(root / "saved1" / "rng_rank0.pt", weights_only=True)
    seed = derived_seed(saved0, 1)
    assert seed == derived_seed(saved0, 1) != derived_seed(saved0, 2)
    seed_rng(seed)
    expected = capture_rng_state()
    # rank 1's state after the load, captured in a fresh 2-rank resume of the 1-rank checkpoint
    _spawn_capture_rank1(str(tiny_model_dir), str(root / "saved1"), str(root / "rank1_rng.pt"))
    assert torch.load(root / "rank1_rng.pt", weights_only=False) == expected


def _capture(rank: int, world: int, port: int, model_dir: str, ckpt_dir: str, out_file: str) -> None:
    import torch.distributed as dist

    from hybridflow.checkpoint import capture_rng_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        actor = _actor(model_dir, rank, world)
        actor.load_checkpoint(ckpt_dir)
        if rank == 1:
            torch.save(capture_rng_state(), out_file)
    finally:
        dist.destroy_process_group()


def _spawn_capture_rank1(*args) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_capture, args=(2, _free_port(), *args), nprocs=2, join=True, start_method="forkserver")


def test_load_without_a_process_group_reshards_too(tiny_model_dir, runs):
    """One process, no torch.distributed at all (a notebook, a converter): the 2-rank state loads."""
    root, out = runs
    threads = torch.get_num_threads()
    # One thread, like the spawned ranks: the k_proj biases' gradient is rounding noise in theory
    # zero (a shift of every key leaves softmax unchanged), and AdamW turns another summation
    # order's noise into ~5e-6 of weight.
    torch.set_num_threads(1)
    try:
        _resume_in_this_process(tiny_model_dir, root, out)
    finally:
        torch.set_num_threads(threads)


def _resume_in_this_process(tiny_model_dir, root: Path, out: dict) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    actor = _actor(str(tiny_model_dir), 0, 1)
    actor.load_checkpoint(str(root / "saved2"))
    got = {"metrics": [_train_step(actor, str(tiny_model_dir), 3, 0, 1)], "params": get_model_state_dict(actor.model)}
    _assert_same_step(got, out[(2, 2)])


def test_per_rank_values_that_differ_are_refused_on_another_rank_count(tmp_path, runs):
    import shutil

    from hybridflow.checkpoint import CheckpointError, load_training_state

    root, _ = runs
    directory = shutil.copytree(root / "saved2", tmp_path / "actor")
    torch.save({"updates": 5}, directory / "extra_rank1.pt")  # rank 1 saved something rank 0 did not
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointError, match=r"actor was saved by 2 ranks and is being loaded by 1: the per-rank "
                                              r"values in extra_rank<r>.pt of ranks \[1\] differ .* resume with 2 ranks"):
        load_training_state(directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
    (directory / "extra_rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"actor is missing \['extra_rank1.pt'\]"):
        load_training_state(directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=0)


def test_another_model_on_another_rank_count_names_both_counts(tmp_path, runs):
    from hybridflow.checkpoint import CheckpointError, load_training_state

    root, _ = runs
    model = torch.nn.Linear(2, 2)  # not the checkpoint's model
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointError, match=r"saved2: loading the sharded model/optimizer state failed on rank 0 "
                                              r"\(saved by 2 ranks, loading on 1\)"):
        load_training_state(root / "saved2", model=model, optimizer=optimizer, scheduler=scheduler, rank=0)


def test_rank_change_note_says_what_is_restored():
    from hybridflow.checkpoint import rank_change_note

    assert rank_change_note(2, 2) is None
    assert rank_change_note(2, 1) == ("saved by 2 ranks, loaded on 1: model and optimizer resharded by "
                                      "torch.distributed.checkpoint; RNG states of rank 0 restored; those of saved "
                                      "rank 1 dropped")
    assert rank_change_note(2, 4) == ("saved by 2 ranks, loaded on 4: model and optimizer resharded by "
                                      "torch.distributed.checkpoint; RNG states of ranks 0-1 restored; ranks 2-3 "
                                      "seeded from sha256(saved rank 0's RNG state, rank)")


def test_float16s_loss_scale_resumes_where_it_was(tiny_model_dir, tmp_path):
    """A float16 run's loss scale backs off in its first steps; a resume that started again at 2^16 would
    retry those overflows and update differently."""
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, TrainerConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.run.stage import prepare_stage
    from hybridflow.training.loss_scale import INITIAL_SCALE
    from recipes.roles import actor_role

    def actor():
        config = HybridFlowConfig(model=ModelConfig(dtype=Dtype.float16), actor=ActorConfig(samples_per_micro_batch=1),
                                  trainer=TrainerConfig(total_steps=10))
        built = actor_role(prepare_stage(config).config, str(tiny_model_dir)).build(WorkerContext(rank=0, world_size=1))
        built.start()
        return built

    import torch.distributed as dist

    had_group = dist.is_initialized()
    try:
        _float16_resume(actor, tmp_path, INITIAL_SCALE)
    finally:  # the workers start a process group of one rank in this process: the next test must not meet it
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()


def _float16_resume(actor, tmp_path, initial_scale: float) -> None:
    saved = actor()
    assert saved.loss_scale.enabled and saved.loss_scale.scale == initial_scale
    saved.loss_scale.load_state_dict({"scale": 512.0, "good_steps": 7, "overflows": 3})
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = actor()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.loss_scale.state_dict() == {"scale": 512.0, "good_steps": 7, "overflows": 3}
