"""Which device the planner's rates describe, and the rates kept per device on the user's machine.

A prediction in seconds is only as good as its rates, and rates belong to one kind of device: the
built-in CPU rates were fitted on this project's 2-core Xeon with AMX, and on a 2-core EPYC without
bf16 instructions a run measured twice the step they predicted. So the planner names the device it
plans for (`this_device`: a CPU by its model name, instruction sets and cores; a GPU by its name and
memory) and chooses its rates (`choose_rates`), in this order:

1. a rates file the config names (`placement.planner.rates`);
2. rates cached for this device under the user's cache directory
   (`$XDG_CACHE_HOME/hybridflow/rates/<device>.json`, ~/.cache by default; `$HYBRIDFLOW_RATES_CACHE`
   instead when set): written by
   `hybridflow plan --calibrate` on this device, and by the running fit below;
3. built-in rates whose device this is (`BUILT_IN`);
4. otherwise the built-in rates of another device, **borrowed**: the plans are still ranked with
   them, but their seconds are that device's and are never shown as a prediction for this one.

The running fit (`update_from_measured`): at the end of a placement=auto run the measured stages
are compared with the prediction (`hybridflow.planning.auto.compare_measured`). A run that planned
with borrowed rates saves the rates scaled to what it measured as this device's; a run whose
measured step is more than `REFIT_ERROR` off its prediction rescales its cached rates toward it (a
per-stage factor on the seconds, `Rates.stage_scale`, moved halfway in log space each time, all the
way the first time). Either way the console says so, and the next run predicts with them.

`HYBRIDFLOW_DEVICE_IDENTITY` replaces the device's name (tests simulate a device with it; a user
can give one name to machines that should share rates).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.planning.cost import STAGES, Rates

IDENTITY_VAR = "HYBRIDFLOW_DEVICE_IDENTITY"
REFIT_ERROR = 0.25  # a measured step further than this from its prediction refits the cached rates


@dataclass(frozen=True)
class DeviceIdentity:
    kind: str  # cpu | cuda
    name: str  # the CPU's model name or the GPU's
    features: tuple[str, ...] = ()  # a CPU's instruction sets among precision.SPEED_CPU_FLAGS
    size: int = 0  # a CPU's cores (this process may use), a GPU's memory in GiB

    @property
    def key(self) -> str:
        """A file name for this device's cached rates."""
        text = "-".join([self.kind, self.name, *self.features, f"{self.size}{'c' if self.kind == 'cpu' else 'g'}"])
        return re.sub(r"[^a-z0-9_.]+", "-", text.lower()).strip("-")

    def describe(self) -> str:
        if self.kind == "cpu":
            return f"{self.name} ({self.size} cores; {', '.join(self.features) or 'no AVX2'})"
        return f"{self.name} ({self.size} GiB)"


def this_device(kind: str) -> DeviceIdentity:
    """The identity of this machine's `kind` device (cpu | cuda)."""
    override = os.environ.get(IDENTITY_VAR)
    if kind == "cuda":
        from hybridflow.checks.memory_budget import local_gpus

        gpus = [] if override else local_gpus()  # nvidia-smi: the driver opens no CUDA context
        if not gpus:
            return DeviceIdentity("cuda", override or "unknown GPU")
        name, memory = gpus[0]
        return DeviceIdentity("cuda", name, (), round(memory / 2 ** 30))
    from hybridflow.precision import cpu_model_name, cpu_speed_flags

    return DeviceIdentity("cpu", override or cpu_model_name(), cpu_speed_flags(), len(os.sched_getaffinity(0)))


def _xeon_2core(device: DeviceIdentity) -> bool:
    return device.kind == "cpu" and "Xeon" in device.name and "amx_bf16" in device.features and device.size == 2


def _gpu(model: str, least_gib: int):
    """A GPU whose name has `model` (as torch and nvidia-smi report it: "NVIDIA H100 80GB HBM3") and
    at least `least_gib` of memory (an unknown size, 0, matches)."""
    def matches(device: DeviceIdentity) -> bool:
        return device.kind == "cuda" and model in device.name.upper() and (device.size == 0 or device.size >= least_gib)
    return matches


def built_in(device: DeviceIdentity) -> Rates | None:
    """The built-in rates of `device`, when there are some for it: this project's 2-core Xeon, and the
    datasheet profiles of the A100 80 GB, H100 and H200 (profiles.py)."""
    from hybridflow.planning.profiles import A100_80GB, CPU_XEON_2CORE, H100_80GB, H200_141GB

    for matches, rates in ((_xeon_2core, CPU_XEON_2CORE), (_gpu("H200", 0), H200_141GB), (_gpu("H100", 0), H100_80GB),
                           (_gpu("A100", 75), A100_80GB)):
        if matches(device):
            return rates
    return None


CACHE_VAR = "HYBRIDFLOW_RATES_CACHE"  # another directory for the cached rates (the tests use their own)


def cache_dir() -> Path:
    if os.environ.get(CACHE_VAR):
        return Path(os.environ[CACHE_VAR])
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hybridflow" / "rates"


def cache_file(device: DeviceIdentity) -> Path:
    return cache_dir() / f"{device.key}.json"


@dataclass(frozen=True)
class RatesChoice:
    rates: Rates
    device: DeviceIdentity
    provenance: str  # file | cached | built-in | borrowed
    note: str  # which rates, for this device or not, and how old

    @property
    def borrowed(self) -> bool:
        return self.provenance == "borrowed"

    def to_dict(self) -> dict:
        return {"provenance": self.provenance, "note": self.note, "device": dataclasses.asdict(self.device),
                "device_key": self.device.key}


def load_rates(path: str | None, device: str) -> Rates:
    """Rates from a calibration's JSON file, or the built-in profile of `device`."""
    if path is not None:
        file = Path(path).expanduser()
        try:
            return Rates.from_json(file.read_text())
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"placement.planner.rates={path!r}: not a rates file from `hybridflow plan --calibrate "
                             f"--save-rates FILE` ({exc})") from None
    from hybridflow.planning.profiles import default_rates

    return default_rates(device)


def choose_rates(path: str | None, kind: str, device: DeviceIdentity | None = None) -> RatesChoice:
    """The rates to plan `kind` devices with (the module docstring's order)."""
    device = device or this_device(kind)
    if path is not None:
        return RatesChoice(load_rates(path, kind), device, "file", f"from {path} (placement.planner.rates)")
    cached = read_cached(device)
    if cached is not None:
        rates, saved = cached
        age_h = (time.time() - saved["saved_at"]) / 3600
        return RatesChoice(rates, device, "cached",
                           f"this device's, {saved['how']} {age_h:.1f} h ago ({cache_file(device)})")
    own = built_in(device)
    if own is not None:
        return RatesChoice(own, device, "built-in", f"built in for this device ({own.source})")
    other = load_rates(None, kind)
    return RatesChoice(other, device, "borrowed",
                       f"BORROWED from another device ({other.source}): none for {device.describe()} yet, so the "
                       "seconds below are that device's, not a prediction for this one; a placement=auto run here "
                       "measures this device's, and `hybridflow plan --calibrate` profiles them")


def read_cached(device: DeviceIdentity) -> tuple[Rates, dict] | None:
    path = cache_file(device)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        return Rates.from_dict(saved["rates"]), saved
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged cache entry is as good as none: the next fit rewrites it


def save_cached(device: DeviceIdentity, rates: Rates, how: str) -> Path:
    """Write `rates` as this device's (atomically: a reader never sees half a file)."""
    path = cache_file(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"device": dataclasses.asdict(device), "how": how, "saved_at": time.time(),
                                   "rates": rates.to_dict()}, indent=2))
    partial.replace(path)
    return path


def refit(rates: Rates, predicted: dict[str, float], measured: dict[str, float], weight: float) -> Rates:
    """`rates` with each stage's seconds scaled toward `measured` (per stage, `weight` of the way in
    log space: 1 lands on it). A stage predicted or measured at zero keeps its factor."""
    scale = dict(rates.stage_scale)
    for stage in STAGES:
        p, m = predicted.get(stage, 0.0), measured.get(stage, 0.0)
        if p > 0 and m > 0:
            scale[stage] = scale.get(stage, 1.0) * math.exp(weight * math.log(m / p))
    return dataclasses.replace(rates, stage_scale=tuple(sorted(scale.items())))


def update_from_measured(saved_plan: dict, predicted: dict[str, float], measured: dict[str, float]) -> str | None:
    """The running fit, at the end of a placement=auto run (`saved_plan`: its plan.json, which names
    the rates' provenance and device): the console line saying what it saved, or None."""
    choice = saved_plan.get("rates_choice")
    if not choice or choice["provenance"] == "file":
        return None  # a rates file the user names is theirs to change
    device = DeviceIdentity(**{**choice["device"], "features": tuple(choice["device"]["features"])})
    rates = Rates.from_dict(saved_plan["rates"])
    error = (predicted["step"] - measured["step"]) / max(measured["step"], 1e-9)
    if choice["provenance"] == "borrowed":
        fitted = dataclasses.replace(refit(rates, predicted, measured, 1.0),
                                     source=f"measured on {device.describe()} (placement=auto's running fit)")
        path = save_cached(device, fitted, "first measured")
        return (f"hybridflow: this device had no rates; saved the rates this run measured as its own ({path}): the "
                "next placement=auto run predicts with them")
    if abs(error) <= REFIT_ERROR:
        return None
    fitted = dataclasses.replace(refit(rates, predicted, measured, 1.0 if choice["provenance"] == "built-in" else 0.5),
                                 source=f"refitted on {device.describe()} (placement=auto's running fit)")
    path = save_cached(device, fitted, "refitted")
    return (f"hybridflow: the measured step was {error:+.0%} off the prediction (more than {REFIT_ERROR:.0%}); "
            f"this device's rates were refitted toward it ({path}) for the next run")
