"""The checks before a run starts: the config's rules across sections and those that ask the runtime
(`rules`), what vLLM cannot run of a model (`model`), the memory one training process holds
(`memory_budget`) and a cheap read of the run's inputs (`preflight`)."""
