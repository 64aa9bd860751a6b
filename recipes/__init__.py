"""The dataflow programs. Each recipe is a function taking the validated HybridFlowConfig."""
