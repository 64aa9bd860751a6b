"""Building a run from config at the edge: model, data, Ray, pools and worker groups.

Recipes call these so that inner code receives built objects (the workers' role specs are
built in recipes/roles.py: the framework does not import workers/). Placement is the stage's
`Plan` (hybridflow/planning/plan.py, decided once by the runner): each role on one of its pools,
all roles on one pool fused into one process per device, the rollout's replicas its TP ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hybridflow.output import console
from hybridflow.builders import build_tiny_model
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.run.cluster import code_files, reserve_pools
from hybridflow.controller import RoleSpec, WorkerGroup, spawn_workers
from hybridflow.controller.pools import CoreLedger
from hybridflow.controller.runtime import connect
from hybridflow.data import ArithmeticSpec, first_operand_below, make_arithmetic_split, read_rows, write_rows
from hybridflow.planning.plan import Plan


def prepare_model(config: HybridFlowConfig, run_dir: Path) -> Path:
    """The model directory: `model.path`, or the tiny model built into run_dir/base_model."""
    if config.model.path is not None:
        path = Path(config.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={config.model.path!r}: no config.json there; give a Hugging Face model directory")
        return path
    return build_tiny_model(run_dir / "base_model", config.model.tiny)


@dataclass
class Datasets:
    train: list[dict]
    val: list[dict]
    train_path: Path
    val_path: Path


def prepare_data(config: HybridFlowConfig, run_dir: Path, tokenizer) -> Datasets:
    """Rows from data.train_path / val_path, or the synthetic task written to run_dir/data; every
    row's prompt fitted to data.max_prompt_tokens with the model's `tokenizer` (and SFT's answers
    checked against rollout.max_response_tokens), before Ray starts (hybridflow/data/prompts.py)."""
    data = config.data
    if data.train_path is not None:
        train_path, val_path = Path(data.train_path), Path(data.val_path)
        train = fit_data(config, read_rows(train_path), tokenizer, f"data file {train_path} (data.train_path)",
                         trained=True)
        val = fit_data(config, read_rows(val_path), tokenizer, f"data file {val_path} (data.val_path)")
        return Datasets(train, val, train_path, val_path)
    return write_synthetic(*synthetic_rows(config, tokenizer), run_dir)


def synthetic_rows(config: HybridFlowConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train, val) rows of the synthetic task (data.synthetic), prompts fitted; not yet written."""
    syn = config.data.synthetic
    spec = ArithmeticSpec(syn.min_digits, syn.max_digits, tuple(syn.operations))
    train, val = make_arithmetic_split(syn.train_rows, syn.val_rows, spec, seed=config.data.seed)
    if syn.train_first_operand_below is not None:
        train = first_operand_below(train, syn.train_first_operand_below, syn.train_rows_not_below)
    train = fit_data(config, train, tokenizer, "the synthetic training rows", trained=True)
    val = fit_data(config, val, tokenizer, "the synthetic validation rows")
    if syn.calculator_demonstrations:
        from hybridflow.data.calculator import demonstration

        train = [{**row, "demonstration": demonstration(row["prompt"])} for row in train]
    return train, val


def write_synthetic(train: list[dict], val: list[dict], run_dir: Path) -> Datasets:
    """The rows a run made itself, written to run_dir/data (what it trained and validated on)."""
    return Datasets(train, val, write_rows(train, run_dir / "data" / "train.parquet"),
                    write_rows(val, run_dir / "data" / "val.parquet"))


def prepare_preference_data(config: HybridFlowConfig, run_dir: Path, tokenizer) -> Datasets:
    """recipe=dpo's pairs before Ray starts: rows in TRL's preference formats from data.train_path /
    val_path (explicit or implicit prompt, text or conversational, multi-turn: hybridflow/data/preference.py),
    each normalised to a prompt and two response texts, or the synthetic task's rows with the right
    answer chosen and a near miss rejected. A row that fits no format raises InputError naming the
    file, row and fix. Prompts are fitted as every recipe's are; a pair over its limits
    (rollout.max_response_tokens, dpo.max_length) raises InputError naming the file, column and rows,
    or with dpo.truncation_mode=keep_start|keep_end is cut, said on the console. The held-out pairs
    are the first trainer.val_prompts."""
    from hybridflow.data.checks import InputError
    from hybridflow.data.preference import pair_limit_problems, preference_rows, synthetic_pairs
    from hybridflow.data.rows import iter_rows
    from hybridflow.data.tokenizer import say_once

    data, dpo = config.data, config.dpo
    try:
        if data.train_path is None:
            task_train, task_val = synthetic_rows(config, tokenizer)
            written = write_synthetic(synthetic_pairs(task_train, data.seed), synthetic_pairs(task_val, data.seed + 1),
                                      run_dir)
            train, val, paths = written.train, written.val, (written.train_path, written.val_path)
            places = ("the synthetic training pairs", "the synthetic validation pairs")
        else:
            paths = (Path(data.train_path), Path(data.val_path))
            places = tuple(f"data file {path} ({key})" for path, key in zip(paths, ("data.train_path", "data.val_path")))
            train, val = (fit_data(config, preference_rows(list(iter_rows(path)), where), tokenizer, where, trained=i == 0)
                          for i, (path, where) in enumerate(zip(paths, places)))
        checked = [pair_limit_problems(rows, tokenizer, data.max_prompt_tokens, config.rollout.max_response_tokens,
                                       dpo.max_length, where) for rows, where in zip((train, val), places)]
    except ValueError as exc:  # a row that fits no format, named by preference_row
        raise InputError(str(exc)) from None
    if dpo.truncation_mode == "error":
        problems = [problem for found, _ in checked for problem in found]
        if problems:
            raise InputError("\n".join(problems))
    else:
        for (_, over), rows, where in zip(checked, (train, val), places):
            if over:
                say_once(f"hybridflow: dpo.truncation_mode={dpo.truncation_mode}: {len(over)} of {len(rows)} pairs of "
                         f"{where} are cut to fit (rollout.max_response_tokens={config.rollout.max_response_tokens}"
                         f", dpo.max_length={dpo.max_length}), e.g. row {over[0]}")
    return Datasets(train, val[: config.trainer.val_prompts], *paths)


def fit_data(config: HybridFlowConfig, rows: list[dict], tokenizer, where: str, trained: bool = False) -> list[dict]:
    """`rows` with data.prompt_truncation applied to every prompt; a prompt longer than
    data.max_prompt_tokens (with `error`), or in SFT's `trained` rows a target longer than
    rollout.max_response_tokens, raises InputError naming the rows. The console names the chat
    template that renders chat prompts."""
    from hybridflow.data.answers import long_sft_targets
    from hybridflow.data.chat import is_chat
    from hybridflow.data.checks import InputError
    from hybridflow.data.prompts import fit_prompt_lengths
    from hybridflow.data.tokenizer import chat_template_name, say_once

    if any(is_chat(row["prompt"]) for row in rows):
        say_once(f"hybridflow: chat prompts are rendered with {chat_template_name(tokenizer, tokenizer.name_or_path)}")
    elif config.data.train_path is not None and getattr(tokenizer, "chat_template", None):
        say_once("hybridflow: the prompts are text, used as they are (the tokenizer's chat template is not applied; "
                 "write prompts as chat messages to use it)")
    kept = fit_prompt_lengths(rows, tokenizer, config.data.max_prompt_tokens, config.data.prompt_truncation, where)
    if trained and len(kept) < len(rows) and len(kept) < config.trainer.prompts_per_step:
        raise InputError(f"{where}: {len(kept)} rows are left after data.prompt_truncation=filter, fewer than "
                         f"trainer.prompts_per_step={config.trainer.prompts_per_step}; fix: raise "
                         "data.max_prompt_tokens, or lower trainer.prompts_per_step")
    rows = kept
    if trained and config.recipe.name == "sft":
        problem = long_sft_targets(rows, tokenizer, config.rollout.max_response_tokens, where)
        if problem:
            raise InputError(problem)
    return rows


def start_ray(config: HybridFlowConfig, plan: Plan) -> str:
    """Join the cluster (ray.address), or start a local Ray with the CPUs the plan's pools reserve, and
    one for the driver (ray.num_cpus overrides); with placement.backend=local nothing ("one process")."""
    if config.placement.one_process:
        return "one process"
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ImportError("placement.backend=ray needs Ray, which is not installed; fix: pip install 'ray[default]', "
                          "or run in one process on one device without Ray: placement=local")
    r = config.ray
    num_cpus = r.num_cpus or max(1, math.ceil(plan.cpus) + 1)
    return connect(address=r.address, num_cpus=num_cpus, dashboard=r.dashboard,
                   dashboard_host=r.dashboard_host, namespace=r.namespace, log_to_driver=not console.quiet(),
                   code_files=code_files(config))


def spawn_roles(config: HybridFlowConfig, plan: Plan, roles: dict[str, RoleSpec],
                env_vars: dict[str, str] | None = None) -> dict[str, WorkerGroup]:
    """Spawn `roles` on their pools of `plan`, on its device; roles sharing a pool share processes, and
    each role's replicas span `plan.replica_size(role)` ranks (the rollout's TP), or the ranks its RoleSpec
    names (a role's sequence-parallel groups: `actor.`, `critic.`, `teacher.sequence_parallel_size`)."""
    import dataclasses

    by_pool: dict[str, dict[str, RoleSpec]] = {}
    for role, spec in roles.items():
        try:
            pool = plan.pool_of(role).name
        except KeyError:
            raise KeyError(f"role {role!r} has no pool: add placement.roles.{role}=<pool name>") from None
        replicas = spec.replica_size if spec.replica_size > 1 else plan.replica_size(role)
        by_pool.setdefault(pool, {})[role] = dataclasses.replace(spec, replica_size=replicas)
    groups: dict[str, WorkerGroup] = {}
    if config.placement.one_process:  # one process, one device: every role here (hybridflow/controller/local.py)
        import os

        from hybridflow.controller.local import spawn_local

        os.environ.update(env_vars or {})  # what a worker process's environment would carry (vLLM's)
        if console.quiet():  # vLLM's records to the driver's log, as a worker's output goes to its log file
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        (pool_name, pool_roles), = by_pool.items()
        groups = spawn_local(f"{pool_name}:{'+'.join(pool_roles)}", plan.device, pool_roles,
                             config.placement.collective_timeout_s)
        _SPAWNED.extend(groups.values())
        return groups
    pools = reserve_pools(config, plan, {name: list(pool_roles) for name, pool_roles in by_pool.items()})
    cores = CoreLedger() if plan.pin_cpus else None  # one ledger: the pools on a node get disjoint cores
    for pool_name, pool_roles in by_pool.items():
        groups.update(spawn_workers(pools[pool_name], pool_roles, env_vars=env_vars,
                                    collective_timeout_s=config.placement.collective_timeout_s,
                                    log_dir=console.worker_log_dir(), cores=cores))
    _SPAWNED.extend(groups.values())
    return groups


_SPAWNED: list[WorkerGroup] = []


def release_all() -> None:
    """Shut down every worker group this driver spawned, so the next stage gets the devices."""
    seen = set()
    while _SPAWNED:
        group = _SPAWNED.pop()
        if (id(group.pool) if group.pool is not None else id(group.hosts[0])) in seen:
            continue
        seen.add(id(group.pool) if group.pool is not None else id(group.hosts[0]))
        group.shutdown()


def vllm_env(config: HybridFlowConfig) -> dict[str, str]:
    """Environment for processes hosting an in-process vLLM engine."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(config.rollout.kv_cache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
    }


def build_weight_sync(config: HybridFlowConfig, plan: Plan, actor: WorkerGroup, rollout: WorkerGroup):
    """The one object that moves the actor's weights into the rollout each step, by the transport the
    stage's `plan` chose for its placement and device (hybridflow.resharding.transports)."""
    from hybridflow.output import console
    from hybridflow.resharding.sync import AdapterSync, WeightSync
    from hybridflow.resharding.transports import build_transport
    from hybridflow.checks.rules import lora_sync

    mode, why = lora_sync(config)
    if mode:
        console.say(f"LoRA weight sync: {'the adapter alone' if mode == 'adapter' else 'the folded model'} ({why})")
    cls = AdapterSync if mode == "adapter" else WeightSync
    return cls(actor, rollout, config.weight_sync, build_transport(plan.rollout_colocated, plan.device, plan.transport),
               config.rollout.dtype.value)
