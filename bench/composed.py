"""What the bench scripts' dry runs share: a composed `hybridflow` command checked against what the
bench sets, so a bench whose overrides stop reaching the config (a key renamed, a placement file
changed) fails its dry run instead of measuring something else."""

from __future__ import annotations


def carried(config, override: str) -> bool:
    """Whether the composed `config` holds what `override` sets: `placement=<file>` by whether its plan
    puts the rollout on a pool of its own, a dotted `key=value` by the key's value."""
    from hybridflow.planning.plan import Plan

    key, text = override.split("=", 1)
    if key == "placement":
        return Plan.from_config(config).rollout_colocated == (text != "disaggregated")
    value = config
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    value = getattr(value, "value", value)  # an Enum's
    if isinstance(value, bool):
        return text == str(value).lower()
    return float(text) == value if isinstance(value, (int, float)) else str(value) == text


def check_composed(overrides: list[str], wanted: dict) -> None:
    """`overrides` composed and checked as `hybridflow` checks them; SystemExit unless the config
    carries each dotted key of `wanted` with its value."""
    from functools import reduce

    from hybridflow.config.stages import compose_command

    config = compose_command(overrides)
    got = {key: reduce(getattr, key.split("."), config) for key in wanted}
    got = {key: getattr(value, "value", value) for key, value in got.items()}  # an enum's value
    wrong = [f"{key}={got[key]!r}, not {value!r}" for key, value in wanted.items() if got[key] != value]
    if wrong:
        raise SystemExit(f"HybridFlow's composed config does not carry what the bench sets: {'; '.join(wrong)} "
                         f"(overrides: {' '.join(overrides)})")
