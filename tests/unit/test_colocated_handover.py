"""The colocated hand-over on GPUs, checked on the CPU by recording the calls it makes: vLLM's
weights wake alone for the sync (the sync's order, `WeightSync.sync_calls`, asked by the transport), the training state leaves before the KV cache comes back, and
each phase's device memory peak is read after it (hybridflow/resharding/transports/colocated.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.config.schema import WeightSyncConfig
from hybridflow.resharding.sync import WeightSync
from hybridflow.resharding.transports.colocated import Colocated


class _Group:
    """A worker group stand-in: each method call (blocking or `.remote`) is recorded."""

    def __init__(self, name: str, calls: list, returns: dict) -> None:
        self.name, self.calls, self.returns = name, calls, returns

    def __getattr__(self, method: str):
        def call(*args):
            self.calls.append(f"{self.name}.{method}" + (f"{list(args[0])}" if args else ""))
            value = self.returns.get(method, True)
            return value() if callable(value) else value

        call.remote = lambda *args: call(*args)
        return call


def _step(moved: bool, peaks: list) -> tuple[list[str], dict]:
    calls: list[str] = []
    peak = iter(peaks)
    actor = _Group("actor", calls, {"offload": moved, "reload": moved, "device_peak_bytes": lambda: [next(peak)]})
    rollout = _Group("rollout", calls, {"wake_up": moved, "sleep": moved})
    transport = Colocated()
    WeightSync(actor, rollout, WeightSyncConfig(), transport, "float32").sync_calls()  # the wake, then the send
    with transport.generating(actor, rollout):
        calls.append("generate")
    return calls, transport.handover_seconds()


def test_on_a_gpu_the_weights_wake_alone_for_the_sync_and_the_kv_cache_after_the_offload():
    gib = 2 ** 30
    calls, handover = _step(True, [3 * gib, 5 * gib, 6 * gib, 5 * gib, 4 * gib])
    assert [c for c in calls if "device_peak" not in c] == [
        "rollout.wake_up['weights']", "actor.send_weights",  # the sync: the training state still on the device
        "actor.offload", "rollout.wake_up['weights', 'kv_cache']",  # the KV cache only once it has left
        "generate", "rollout.sleep", "actor.reload"]
    assert [c for c in calls[calls.index("actor.offload"):] if c.endswith("device_peak_bytes")] == \
        ["actor.device_peak_bytes"] * 5  # one read after each phase
    assert {k: v for k, v in handover.items() if k.startswith("memory/")} == {
        "memory/device_peak_offload_gib": 3.0, "memory/device_peak_engine_wake_gib": 5.0,
        "memory/device_peak_generate_gib": 6.0, "memory/device_peak_engine_sleep_gib": 5.0,
        "memory/device_peak_reload_gib": 4.0}
    assert sorted(k for k in handover if k.startswith("timing/")) == [
        "timing/engine_sleep_s", "timing/engine_wake_s", "timing/offload_s", "timing/reload_s"]


def test_on_the_cpu_nothing_moves_and_nothing_is_reported():
    calls, handover = _step(False, [None] * 5)
    assert "generate" in calls and handover == {}


class _Engine:
    def __init__(self) -> None:
        self.calls: list = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))


def _rollout(device: str):
    from workers.rollout.vllm_rollout import VLLMRollout

    rollout = VLLMRollout(SimpleNamespace(device=device), "m", SimpleNamespace(), 8, 0, 0)
    rollout.engine = _Engine()
    return rollout


def test_the_engine_wakes_only_the_parts_that_sleep():
    rollout = _rollout("cuda")
    assert rollout.wake_up(["weights"]) is False  # awake: nothing to do
    assert rollout.sleep() is True and rollout.sleep() is False
    assert rollout.wake_up(["weights"]) is True
    assert rollout.wake_up(["weights", "kv_cache"]) is True and rollout.wake_up() is False
    assert rollout.engine.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match=r"unknown parts \['kv'\]"):
        rollout.wake_up(["kv"])
    cpu = _rollout("cpu")
    assert cpu.sleep() is False and cpu.wake_up() is False and cpu.engine.calls == []
