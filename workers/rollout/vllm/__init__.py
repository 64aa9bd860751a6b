"""What only the vLLM engine (workers/rollout/vllm_rollout.py) uses of the weight path, kept with it:
`receiver` (`VLLMReceiver`: the engine's receiving end, which the transports of hybridflow/resharding
deliver to), `transfer` (our engine in vLLM's weight-transfer framework and the functions run inside
vLLM's worker through `collective_rpc`), `regions` (which part of each checkpoint tensor a rank's
loaders read, found by watching vLLM's own loaders). The framework imports none of it."""
