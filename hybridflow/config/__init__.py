"""Configuration: typed schema, Hydra registration, and conversion to validated objects."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from hybridflow.config.schema import HybridFlowConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SCHEMA_NAME = "hybridflow_schema"


class ConfigError(ValueError):
    """The composed configuration is invalid; the message names the key, the value and the fix."""


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore; conf/config.yaml lists it first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=HybridFlowConfig)


def to_config(cfg: DictConfig) -> HybridFlowConfig:
    """The composed config as typed dataclasses, as this machine runs it: each section's own rules run as it is
    built, then it is resolved (`hybridflow.checks.rules.resolved`: dtypes, probe tolerance) and every rule across
    sections the config alone can break is checked (`hybridflow.checks.rules.config_problems`). The rules its plan
    can break run once the stage's plan is decided (`hybridflow.run.stage.prepare_stage`)."""
    from hybridflow.checks.rules import config_problems, resolved

    try:
        config = OmegaConf.to_object(cfg)
    except Exception as exc:  # OmegaConf wraps __post_init__ errors; keep only the message
        message = str(exc).split("\n    full_key")[0].strip()
        raise ConfigError(message) from None
    if not isinstance(config, HybridFlowConfig):
        raise ConfigError(f"the composed config is a {type(config).__name__}, not HybridFlowConfig; "
                          f"conf/config.yaml must list '{SCHEMA_NAME}' first in its defaults")
    try:
        config = resolved(config)
        problems = config_problems(config)
    except ValueError as exc:  # a plug-in's name that does not load, a dtype this machine cannot compute in
        raise ConfigError(str(exc)) from None
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def compose(overrides: list[str] | None = None, config_name: str = "config") -> HybridFlowConfig:
    """Compose conf/ with `overrides` (as on the command line) outside of a Hydra main."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
    return to_config(cfg)


register_schema()
