"""Checks of a run's inputs before anything starts: no run directory, no Ray, no model loaded.

What the config plus a cheap read of the inputs can show:
- data files: readable, their columns, each checked row's `prompt` (text or chat messages) and the
  columns that the reward functions (and SFT's answers) need; row counts against one step's
  prompts and against the validation size;
- the model directory (and a reward model's): config.json, weights, tokenizer files, and a chat
  template when the data has chat prompts;
- every reward function loads, and each argument it requires can be filled from the data's columns;
- once all of that is right, the prompts of the rows read fit data.max_prompt_tokens with the
  model's tokenizer (chat prompts rendered with its template; unless data.prompt_truncation is
  left or filter), and SFT's answers fit rollout.max_response_tokens.
Every problem found is reported at once, each naming the file or key, the row(s), the column, the
value's type and the fix.

Cost, so that a good run's start-up barely grows: a parquet file's row count and columns come
from its footer; rows are read only up to `SAMPLE_ROWS` per file with `data.validate_rows=sample`
(the default), because `read_rows` checks every row's prompt again during the one full read that
follows (still before Ray starts). `all` streams every row here first (a second pass over the
file); `none` reads only the footer or first line. Reward functions are imported in the driver to
read their signatures, as the reward role will import them again in its own process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hybridflow.agents.hubs import load_hub_environment
from hybridflow.config.recipes import recipe_spec
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.data.checks import InputError  # raised here, and by the full read of the data (data/prompts.py)
from hybridflow.planning.plan import Plan

SAMPLE_ROWS = 1000
SYNTHETIC_COLUMNS = ("prompt", "ground_truth", "data_source")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
MODEL_FIX = "save the model there with model.save_pretrained(dir) and tokenizer.save_pretrained(dir)"




def check_inputs(config: HybridFlowConfig, plan: Plan | None = None) -> None:
    """Raise `InputError` listing every problem with the run's data, model and reward functions; `plan`:
    the run's (hybridflow.run.stage.Stage.plan), which the memory check prices.

    A pipeline is checked stage by stage (each stage composes its own config, on its own plan); a later
    stage's model is made by the stage before it, so only the first stage's model directory is checked.
    """
    if recipe_spec(config.recipe.name).pipeline:
        problems = [f"{label}: {problem}" for label, stage, first in _pipeline_stages(config)
                    for problem in check_run(stage, check_model=first, plan=_own_plan(stage))]
    else:
        problems = check_run(config, plan=plan)
    problems += _cluster_problems(config)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise InputError(f"{len(problems)} problem(s) with the run's inputs, found before anything started:\n{listed}")


def _cluster_problems(config: HybridFlowConfig) -> list[str]:
    """The cluster the run joins (ray.address, else RAY_ADDRESS), when nothing answers there."""
    from hybridflow.controller.runtime import join_address, unreachable_head

    if config.placement.one_process:  # one process: no cluster to join, and none asked for
        address = join_address(config.ray.address)
        return [f"RAY_ADDRESS={address!r} (the environment) asks to join a Ray cluster, and placement.backend=local "
                "runs in this one process: unset RAY_ADDRESS, or use placement.backend=ray to run on that cluster"
                ] if address else []
    key = "ray.address" if config.ray.address else "RAY_ADDRESS (the environment)"
    problem = unreachable_head(join_address(config.ray.address), key)
    return [problem] if problem else []


def _engine_checks(config: HybridFlowConfig):
    """The rollout engine's own checks (`RolloutEngine.checks`), or one that finds nothing."""
    from hybridflow.config.engines import rollout_engine
    from hybridflow.registry import load_object

    engine = rollout_engine(config.rollout.backend)
    return load_object(engine.checks) if engine.checks else (lambda config, model_path: [])


def _own_plan(config: HybridFlowConfig) -> Plan | None:
    """A pipeline stage's plan, when it is its config's own (placement=auto's is decided as the stage starts)."""
    if config.placement.planner.auto:
        return None
    from hybridflow.planning.auto import decide_plan

    return decide_plan(config).plan


def check_run(config: HybridFlowConfig, check_model: bool = True, plan: Plan | None = None) -> list[str]:
    """The problems of one run's inputs (empty when it can start); with its `plan`, whether its training
    roles fit their devices (placement=auto's search has checked the plan it chose)."""
    # a recipe that scores nothing (dpo, pretrain) needs no reward function's columns
    functions, problems = _reward_functions(config) if recipe_spec(config.recipe.name).reads_key("reward") else ([], [])
    generates = recipe_spec(config.recipe.name).reads_key("rollout.backend")  # not dpo, pretrain
    engine_checks = _engine_checks(config) if generates else (lambda config, model_path: [])
    problems += _agent_problems(config) + _environment_problems(config) + engine_checks(config, None)
    model_path = config.model.path if check_model else None
    if model_path is not None:
        problems += check_model_dir(model_path, "model.path") + engine_checks(config, model_path)
        if recipe_spec(config.recipe.name).trains and not problems and plan is not None \
                and not config.placement.planner.auto:
            from hybridflow.checks.memory_budget import memory_problems  # placement=auto: the planner's rules check memory

            problems += memory_problems(config, plan)
    if config.reward.reward_model.path is not None:
        problems += check_model_dir(config.reward.reward_model.path, "reward.reward_model.path")
    if config.teacher_role_runs and check_model:
        problems += _teacher_problems(config)
    needed = _needed_columns(config, functions)
    if config.data.train_path is None:
        return problems + _check_synthetic(config, {**needed, **_teacher_column(config)})
    train_rows, val_rows = _row_needs(config)
    files = {}
    for key, path, min_rows in (("data.train_path", config.data.train_path, train_rows),
                                ("data.val_path", config.data.val_path, val_rows)):
        wanted = {**needed, **_teacher_column(config)} if key == "data.train_path" else needed
        files[key] = facts = check_data_file(path, key, wanted, min_rows, config.data.validate_rows, functions,
                                             rows_as=_preference_row if recipe_spec(config.recipe.name).preference else None)
        problems += facts.problems
        if facts.first_chat_row is not None and model_path is not None and not has_chat_template(model_path):
            problems.append(f"data file {path} ({key}), column 'prompt', row {facts.first_chat_row}: a list of chat "
                            f"messages, but the tokenizer in model.path={model_path!r} has no chat template; fix: "
                            "use a model whose tokenizer has one (tokenizer_config.json 'chat_template', or "
                            "chat_template.jinja), or write the prompts as text")
    if not problems and check_model:  # lengths need a working tokenizer: only once all else is right
        problems += _prompt_length_problems(config, files)
    return problems


def _prompt_length_problems(config: HybridFlowConfig, files: dict[str, "FileFacts"]) -> list[str]:
    """Prompts (of the rows read) longer than data.max_prompt_tokens with the model's tokenizer (when
    data.prompt_truncation=error), and in SFT answers longer than rollout.max_response_tokens. Every
    row is checked again as the data is loaded (hybridflow.run.launch.fit_data), still before Ray starts.

    Loading the tokenizer imports transformers, which the recipe imports next anyway: a good run
    pays only for reading the tokenizer files once more.
    """
    from hybridflow.data.answers import long_sft_targets
    from hybridflow.data.prompts import prompt_token_ids

    try:
        tokenizer = _load_tokenizer(config)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the problem to report
        return [f"model.path={config.model.path!r}: its tokenizer does not load ({type(exc).__name__}: {exc}); "
                f"fix: {MODEL_FIX}"]
    limit, problems = config.data.max_prompt_tokens, []
    for key, facts in files.items():
        if not facts.prompts:
            continue
        where = f"data file {facts.path} ({key})"
        _, token_ids = prompt_token_ids([prompt for _, prompt in facts.prompts], tokenizer)
        long = [(row, len(ids)) for (row, _), ids in zip(facts.prompts, token_ids) if len(ids) > limit]
        if long and config.data.prompt_truncation == "error":
            more = f" and {len(long) - 5} more" if len(long) > 5 else ""
            listed = ", ".join(str(row) for row, _ in long[:5]) + more
            problems.append(f"{where}, column 'prompt', row(s) {listed}: row {long[0][0]} has "
                            f"{long[0][1]} tokens, more than data.max_prompt_tokens={limit}; fix: raise "
                            f"data.max_prompt_tokens to {max(n for _, n in long)}, shorten the prompts, or set "
                            "data.prompt_truncation=left|filter")
        if config.recipe.name == "sft" and key == "data.train_path":  # validation only generates
            problem = long_sft_targets(facts.targets, tokenizer, config.rollout.max_response_tokens, where,
                                       indices=[row for row, _ in facts.prompts])
            problems += [problem] if problem else []
    return problems


def _teacher_problems(config: HybridFlowConfig) -> list[str]:
    """Each teacher's directory, and its tokenizer against the student's: a teacher scores the student's
    token ids, so the two must map every id to the same token."""
    from hybridflow.data.tokenizer import load_tokenizer

    problems, student = [], None
    for role, path in config.teacher.paths.items():
        key = "teacher.path" if role == "teacher" else f"teacher.teachers.{role.split('.', 1)[1]}"
        found = check_model_dir(path, key)
        if found:
            problems += found
            continue
        student = student if student is not None else _load_tokenizer(config).get_vocab()
        teacher = load_tokenizer(path, config.model.trust_remote_code).get_vocab()
        if teacher == student:
            continue
        differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda item: item[1])[:3]
        student_name = config.model.path or "the tiny model's character tokenizer (model.path=null)"
        problems.append(
            f"{key}={path!r}: its tokenizer ({len(teacher)} tokens) is not the student's ({student_name}, "
            f"{len(student)} tokens); e.g. {', '.join(f'{t!r} -> {i}' for t, i in differ)} is in one and not the "
            "other. The teacher scores the student's token ids, which would then name other tokens. Fix: a teacher "
            "trained with the student's tokenizer (the same model family), or distil from the teacher's own samples "
            "with SFT (recipe=sft on its generations)")
    return problems


def _load_tokenizer(config: HybridFlowConfig):
    if config.model.path is None:
        from hybridflow.builders.tiny_model import build_char_tokenizer

        return build_char_tokenizer()
    from hybridflow.data.tokenizer import load_tokenizer

    return load_tokenizer(config.model.path, config.model.trust_remote_code)


# ---- reward functions ---------------------------------------------------------------------------


def _reward_functions(config: HybridFlowConfig) -> tuple[list, list[str]]:
    """The configured reward functions, loaded and wrapped; a load or signature error is a problem."""
    from hybridflow.rewards.composer import build_reward_function
    from hybridflow.rewards.functions import RewardFunctionError

    functions, problems = [], []
    for spec, key in zip(config.reward.function_specs(), config.reward.function_keys()):
        try:
            functions.append(build_reward_function(spec, key))
        except RewardFunctionError as exc:
            problems.append(f"{exc}; fix the function or {key}")
    return functions, problems


def _agent_problems(config: HybridFlowConfig) -> list[str]:
    """rollout.agent's tools and environments load and have the right shape (the rollout role
    loads them again in its own processes)."""
    if not config.rollout.agent:
        return []
    from hybridflow.agents import AgentError, load_agents

    try:
        load_agents(config.rollout.agent, config.rollout.agent_column, config.rollout.openenv,
                    config.rollout.tool_timeout_s)
    except AgentError as exc:
        return [str(exc)]
    return []


def _environment_problems(config: HybridFlowConfig) -> list[str]:
    """rollout.environment loads with rollout.environment_args, and runs here: its package, its seats'
    runtimes and harnesses (the rollout role loads it again in its own processes)."""
    if not config.rollout.environment:
        return []

    try:
        load_hub_environment(config.rollout.environment, config.rollout.environment_args)
    except (ValueError, ImportError, RuntimeError) as exc:  # AgentError is a ValueError
        return [f"rollout.environment={config.rollout.environment}: {exc}"]
    return []


def _needed_columns(config: HybridFlowConfig, functions: list) -> dict[str, str]:
    """Data column -> why the run needs it in every row."""
    needed: dict[str, str] = {}
    for fn in functions:
        for name in fn.data_arguments(agent_rollout=bool(config.rollout.agent),
                                      environment_rollout=bool(config.rollout.environment)):
            needed.setdefault(name, f"reward function {fn.reference!r} ({fn.key}) requires the argument {name!r}")
    spec = recipe_spec(config.recipe.name)
    if spec.answers:
        needed.setdefault("ground_truth", f"recipe={config.recipe.name} trains on it as each prompt's answer")
    if spec.preference:
        for column in ("chosen", "rejected"):
            needed.setdefault(column, f"recipe={config.recipe.name} trains on each prompt's {column} response "
                                      "(TRL's preference format: prompt, chosen, rejected)")
    return needed


def _teacher_column(config: HybridFlowConfig) -> dict[str, tuple[str, str]]:
    """The training data's column naming each prompt's teacher, with several teachers: why, and the fix."""
    t = config.teacher
    if not (config.teacher_role_runs and t.teachers):
        return {}
    return {t.column: (f"teacher.teachers routes each training prompt to the teacher its teacher.column={t.column!r} "
                       f"names ({', '.join(t.teachers)})",
                       f"add a {t.column!r} column naming one of {sorted(t.teachers)} in every training row, or name "
                       "the column that does in teacher.column")}


def _fix_of(column: str, need) -> tuple[str, str]:
    """(why, fix) of a needed column: a reward function's argument unless the need names its own fix."""
    return need if isinstance(need, tuple) else (need, _argument_fix(column))


def _argument_fix(column: str) -> str:
    from hybridflow.rewards.functions import AGENT_ARGUMENTS, ENVIRONMENT_ARGUMENTS

    if column in ("chosen", "rejected"):
        return (f"add a {column!r} column (text, or chat messages ending with the assistant's turn), or rename "
                "yours to it")
    if column in ENVIRONMENT_ARGUMENTS:
        return (f"{column!r} is filled by a hub environment's rollout: set rollout.environment (docs/agents.md), "
                "or give the function's parameter a default")
    if column in AGENT_ARGUMENTS:
        return (f"{column!r} is filled by an agent rollout: set rollout.agent (docs/agents.md), or give the "
                "function's parameter a default")
    return (f"add a {column!r} column to the data, give the function's parameter a default, or set it as a fixed "
            f"argument (reward.functions=[{{fn: ..., kwargs: {{{column}: ...}}}}])")


# ---- data ------------------------------------------------------------------------------------------


def _row_needs(config: HybridFlowConfig) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """(key, rows) the training and the validation file must have at least, if the recipe needs them."""
    spec, trainer = recipe_spec(config.recipe.name), config.trainer
    train = ("trainer.prompts_per_step", trainer.prompts_per_step) if spec.trains else None
    val = ("trainer.val_prompts", trainer.val_prompts) if spec.validates else None
    return train, val


def _check_synthetic(config: HybridFlowConfig, needed: dict[str, str]) -> list[str]:
    made = ("chosen", "rejected") if recipe_spec(config.recipe.name).preference else ()  # its pairs are made from it
    problems = [f"data: the synthetic task has no column {column!r} (it has {list(SYNTHETIC_COLUMNS)}), but "
                f"{why}; fix: {fix}" for column, (why, fix) in ((c, _fix_of(c, n)) for c, n in needed.items())
                if column not in SYNTHETIC_COLUMNS + made]
    train, val = _row_needs(config)
    syn = config.data.synthetic
    for need, rows_key, rows in ((train, "data.synthetic.train_rows", syn.train_rows),
                                 (val, "data.synthetic.val_rows", syn.val_rows)):
        if need is not None and rows < need[1]:
            problems.append(f"config {need[0]}={need[1]} is more than {rows_key}={rows}; lower {need[0]} to at most "
                            f"{rows} or raise {rows_key}")
    return problems


@dataclass
class FileFacts:
    path: str
    problems: list[str] = field(default_factory=list)
    first_chat_row: int | None = None
    prompts: list = field(default_factory=list)  # (row, prompt) of the first rows read, for length checks
    targets: list = field(default_factory=list)  # their SFT targets (ground_truth, demonstration)


def check_data_file(path: str, key: str, needed: dict[str, str], min_rows: tuple[str, int] | None,
                    mode: str, functions: list = (), rows_as=None) -> FileFacts:
    """Check one data file: readable, columns present, rows well-typed (per `mode`), enough rows.
    `rows_as(row, index, where)`: each row as the recipe reads it (recipe=dpo: TRL's preference
    formats, whose implicit prompt is no column of the file), raising ValueError naming a bad row."""
    from hybridflow.data.rows import count_rows

    where = f"data file {path} ({key})"
    try:
        columns, checker, rows_read = _read_rows(path, needed, mode, rows_as, where)
        need = max(min_rows[1] if min_rows else 1, rows_read + 1)  # +1: are there rows beyond those read?
        total, exact = (rows_read, True) if mode == "all" else count_rows(path, at_least=need)
    except (OSError, ValueError) as exc:  # unreadable: a missing file, bad JSON, not parquet (ArrowInvalid)
        message = str(exc) if str(path) in str(exc) else f"{where}: {type(exc).__name__}: {exc}"
        fix = "" if "; " in message else "; fix: give a readable .parquet or .jsonl file"
        return FileFacts(path, [message + fix])
    facts = FileFacts(path, first_chat_row=checker.first_chat_row, prompts=checker.prompts, targets=checker.targets)
    if total == 0:
        facts.problems.append(f"{where} has no rows; fix: point {key} at a file with rows")
        return facts
    if min_rows is not None and total < min_rows[1]:
        facts.problems.append(f"{where} has {total} rows, fewer than {min_rows[0]}={min_rows[1]}; fix: lower "
                              f"{min_rows[0]} to at most {total}, or add rows")
    facts.problems += _column_problems(where, columns, needed, functions)
    facts.problems += checker.messages(where, skip=[c for c in ("prompt", *needed) if c not in columns])
    if mode == "sample" and rows_read < total:
        of = f"of {total} rows" if exact else "rows (of more)"
        print(f"hybridflow: checked the first {rows_read} {of} of {path} (data.validate_rows=sample); every row's "
              "prompt is checked as the file is loaded", flush=True)
    return facts


def _read_rows(path: str, needed: dict[str, str], mode: str, rows_as=None, where: str = ""):
    """(columns, RowChecker over the rows read, rows read): every row with `all`, the first
    SAMPLE_ROWS with `sample`, and with `none` the first row only, for a JSON lines file's columns."""
    from hybridflow.data.checks import RowChecker
    from hybridflow.data.rows import check_row_file, iter_rows, parquet_columns

    check_row_file(path)
    columns = parquet_columns(path) if str(path).endswith(".parquet") else []
    checker = RowChecker(needed, keep_prompts=SAMPLE_ROWS)
    limit = None if mode == "all" else SAMPLE_ROWS if mode == "sample" else 1
    rows_read = 0
    for index, row in enumerate(iter_rows(path, limit)):
        if rows_as is not None:
            row = rows_as(row, index, where)
        columns += [c for c in row if c not in columns]  # JSON lines: the union of the rows' keys
        if mode != "none":
            checker.check(index, row)
        rows_read += 1
    return columns, checker, rows_read


def _preference_row(row: dict, index: int, where: str) -> dict:
    """recipe=dpo's rows: TRL's preference formats (hybridflow/data/preference.py); a row with too
    little to judge (a missing response column) is left to the column checks."""
    from hybridflow.data.preference import RESPONSE_COLUMNS, preference_row

    if any(row.get(column) is None for column in RESPONSE_COLUMNS):
        return row
    return preference_row(row, index, where)


def _column_problems(where: str, columns: list[str], needed: dict[str, str], functions) -> list[str]:
    problems = [f"{where}: no column 'prompt' (columns: {columns}); fix: name the prompt column 'prompt'"] \
        if "prompt" not in columns else []
    problems += [f"{where}: no column {column!r} (columns: {columns}), but {why}; fix: {fix}"
                 for column, (why, fix) in ((c, _fix_of(c, n)) for c, n in needed.items())
                 if column not in columns and column != "prompt"]
    for fn in functions:
        clash = fn.clashing_columns(columns)
        if clash:
            problems.append(f"{where}: column(s) {clash} are also fixed arguments in {fn.key}.kwargs of reward "
                            f"function {fn.reference!r}; fix: rename the fixed argument or drop the column")
    return problems


# ---- model directories ----------------------------------------------------------------------------


def check_model_dir(path: str, key: str) -> list[str]:
    """Problems of a Hugging Face model directory: config.json, weights, tokenizer files."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return [f"{key}={path!r}: no such directory; fix: give a Hugging Face model directory (config.json, "
                "weights, tokenizer files)"]
    problems = _config_problems(root, key) + _weight_problems(root, key)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{key}={path!r}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {root}; fix: "
                        "copy the base model's tokenizer there (tokenizer.save_pretrained(dir))")
    return problems


def _config_problems(root: Path, key: str) -> list[str]:
    config_file = root / "config.json"
    if not config_file.is_file():
        return [f"{key}={str(root)!r}: no config.json in {root}; fix: {MODEL_FIX}"]
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"{config_file} ({key}): not valid JSON ({exc}); fix: {MODEL_FIX}"]
    if not isinstance(config, dict) or "model_type" not in config:
        return [f"{config_file} ({key}): no 'model_type' key, so transformers cannot tell the architecture; fix: "
                f"{MODEL_FIX}"]
    return []


def _weight_problems(root: Path, key: str) -> list[str]:
    for index_name in WEIGHT_INDEXES:
        index = root / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                return [f"{index} ({key}): not a weight index ({type(exc).__name__}: {exc}); fix: {MODEL_FIX}"]
            missing = [s for s in shards if not (root / s).is_file()]
            return [f"{key}={str(root)!r}: {index_name} lists weight file(s) {missing[:3]} that are not in {root}; "
                    "fix: copy every shard into the directory"] if missing else []
    weights = sorted(root.glob("*.safetensors")) + sorted(root.glob("pytorch_model*.bin"))
    if not weights:
        return [f"{key}={str(root)!r}: no weights (*.safetensors or pytorch_model*.bin) in {root}; fix: {MODEL_FIX}, "
                f"or point {key} at the directory that has them"]
    return [problem for w in weights if w.suffix == ".safetensors" for problem in _safetensors_header(w, key)]


def _safetensors_header(path: Path, key: str) -> list[str]:
    """A safetensors file starts with an 8-byte header length, then that many bytes of JSON."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    header_bytes = int.from_bytes(head, "little") if len(head) == 8 else -1
    if header_bytes < 2 or 8 + header_bytes > size:
        return [f"{path} ({key}): {size} bytes, not a complete safetensors file (truncated or empty); fix: "
                "copy or save the weights again"]
    return []


def has_chat_template(path: str) -> bool:
    """Whether a model directory's tokenizer has a chat template (read from its files, cheaply)."""
    root = Path(path).expanduser()
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((root / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


# ---- pipelines ------------------------------------------------------------------------------------


def _pipeline_stages(config: HybridFlowConfig) -> Iterator[tuple[str, HybridFlowConfig, bool]]:
    """(label, config, is_first) per stage, composed as the pipeline recipe composes them. A stage
    whose overrides do not compose is left to the pipeline's own stage check, which names it."""
    from hybridflow.config import compose
    from hybridflow.run.pipeline_stages import stage_overrides

    for index, stage in enumerate(config.pipeline.stages):
        model_path = config.model.path if index == 0 else None
        try:
            stage_config = compose(stage_overrides(config, index, model_path, Path(config.logger.output_root),
                                                   stage.name))
        except Exception:  # noqa: BLE001 - reported by recipes.pipeline.check_stages with the stage named
            continue
        yield f"pipeline.stages[{index}] ({stage.name})", stage_config, index == 0
