"""A shaped reward the untrained tiny model can learn from: the share of digits in the response
(bench/precision_curves.sh: GRPO from scratch in float32 and in bfloat16)."""


def score(response, **_):
    return sum(c.isdigit() for c in response) / max(1, len(response))
