"""Test-only worker subclasses (imported by Ray workers by module path)."""

from __future__ import annotations

from hybridflow.controller import Dispatch, register
from workers.rollout.vllm_rollout import VLLMRollout


class CorruptibleVLLMRollout(VLLMRollout):
    @register(Dispatch.ONE_TO_ALL)
    def corrupt_parameter(self, name_fragment: str) -> str:
        """Add 1 to the first engine parameter whose name contains `name_fragment`."""

        def corrupt(worker, fragment=name_fragment):
            for name, param in worker.model_runner.get_model().named_parameters():
                if fragment in name and param.numel():
                    param.data.add_(1.0)
                    return name
            raise KeyError(f"no vLLM parameter matches {fragment!r}")

        return self.engine.collective_rpc(corrupt)[0]

    @register(Dispatch.ONE_TO_ALL)
    def inject_weight_sync_fault(self, kind: str, bucket: int) -> bool:
        """`corrupt` the received bucket, or `exit` this process when it arrives."""
        from hybridflow.resharding import faults

        {"corrupt": faults.corrupt_bucket, "exit": faults.exit_at_bucket}[kind](bucket)
        return True


class RecordingVLLMRollout(VLLMRollout):
    """Records what the engine was asked and what it sampled, as token ids (agent tests)."""

    @register(Dispatch.ONE_TO_ALL)
    def start_engine(self) -> float:
        seconds = super().start_engine()
        self.records: list[tuple[list[int], list[int]]] = []  # (prompt ids, sampled ids) per request
        generate = self.engine.generate

        def recording(prompts, params, **kwargs):
            outputs = generate(prompts, params, **kwargs)
            self.records += [(list(p["prompt_token_ids"]), list(o.outputs[0].token_ids))
                             for p, o in zip(prompts, outputs)]
            return outputs

        self.engine.generate = recording
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def recorded(self) -> list[tuple[list[int], list[int]]]:
        return self.records
