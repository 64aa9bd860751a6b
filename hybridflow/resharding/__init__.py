"""Moving the actor's weights from the training layout to the generation layout."""

from hybridflow.resharding.colocated import (
    WeightSyncError,
    full_weights,
    load_into_vllm,
    probe_vllm_log_probs,
    vllm_checksums,
    verify_vllm_weights,
    weight_checksums,
)

__all__ = ["WeightSyncError", "full_weights", "load_into_vllm", "probe_vllm_log_probs", "vllm_checksums", "verify_vllm_weights",
           "weight_checksums"]
