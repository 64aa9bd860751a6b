"""Every `hybridflow` / `hybridflow-merge` command in README.md and docs/ (docs/results/ too) runs as written: it
composes (Hydra, the schema's rules, the pipeline's routing), and each override it names is in the
composed config of every stage that should get it. No Ray, no model: composition only."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.output.tracking import _jsonable

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]  # the guides and the results pages
COMMAND = re.compile(r"^(?:\S*/)?(hybridflow|hybridflow-merge)$")
SHELL_STOPS = {">", "2>", "|", "&&", ";", "2>&1", ">>"}


@dataclass
class Command:
    where: str  # file:line
    program: str  # hybridflow | hybridflow-merge
    args: list[str]


def commands_in(path: Path) -> list[Command]:
    """Commands in fenced code blocks (continued lines joined, `$NAME` from `NAME="..."` in the block
    expanded) and inline `hybridflow ...` spans in the prose."""
    found, text = [], path.read_text()
    lines, in_block, variables, pending, start = text.splitlines(), False, {}, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block, variables = not in_block, {}
            continue
        if not in_block:
            for span in re.findall(r"`(hybridflow [^`]*)`", line):
                found += _parse(f"{path.name}:{number}", span, {})
            continue
        if not pending:
            start = number
        pending += " " + line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        assignment = re.match(r'^\s*([A-Z_]+)="(.*)"\s*$', pending)
        if assignment:
            variables[assignment[1]] = assignment[2]
        else:
            found += _parse(f"{path.name}:{start}", pending, variables)
        pending = ""
    return found


def _parse(where: str, text: str, variables: dict[str, str]) -> list[Command]:
    for name, value in variables.items():
        text = text.replace(f"${name}", value)
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return []
    for i, word in enumerate(words):
        match = COMMAND.match(word)
        if match:
            args = []
            for arg in words[i + 1:]:
                if arg in SHELL_STOPS:
                    break
                args.append(arg)
            return [Command(where, match[1], args)]
    return []


ALL = [c for path in DOCS for c in commands_in(path)]


def problems_of(command: Command) -> list[str]:
    """What is wrong with one documented command (empty when it runs as written)."""
    if command.program == "hybridflow-merge":
        from hybridflow.merge.cli import build_parser

        try:
            build_parser().parse_args(command.args)
        except SystemExit:
            return [f"hybridflow-merge {' '.join(command.args)}: the arguments do not parse"]
        return []
    if command.args[:1] == ["plan"]:  # `hybridflow plan [flags] OVERRIDES`: its flags parse, its overrides compose
        from hybridflow.planning.cli import parser

        try:
            command = Command(command.where, command.program, parser().parse_args(command.args[1:]).overrides)
        except SystemExit:
            return [f"hybridflow {' '.join(command.args)}: the flags do not parse"]
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.config.recipes import recipe_spec
    from hybridflow.run.pipeline_stages import STAGE_SCOPED, override_key, pipeline_owned

    try:
        config, stages = compose_command(command.args, with_stages=True)
    except Exception as error:  # noqa: BLE001 - any refusal is the problem to report
        return [f"does not compose: {str(error).splitlines()[0]}"]
    problems = []
    for override in command.args:
        scoped = STAGE_SCOPED.match(override)
        inner = scoped["override"] if scoped else override
        key, value = override_key(inner), _value(inner)
        if value is _GROUP or override.startswith("~"):
            continue
        if not stages or pipeline_owned(key):
            targets = {"the run": config}
        else:
            targets = {name: c for name, c in stages.items()
                       if (scoped["stage"] == name if scoped else recipe_spec(c.recipe.name).reads_key(key))}
        for name, target in targets.items():
            got = _select(target, key)
            if not _matches(value, got):
                problems.append(f"{override}: {name} has {key}={got!r}")
    return problems


_GROUP = object()


def _value(override: str):
    """The override's value as Hydra parses it; _GROUP for a config group choice (model=local_hf)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([override])[0]
    if parsed.is_delete():
        return _GROUP
    key = parsed.key_or_group
    from hybridflow.config import CONF_DIR

    if "." not in key and (CONF_DIR / key).is_dir():
        return _GROUP
    return OmegaConf.to_container(OmegaConf.create({"v": parsed.value()}))["v"]  # Hydra's types -> plain


def _select(config, key: str):
    value = OmegaConf.select(OmegaConf.create(_jsonable(config)), key, throw_on_missing=False)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _matches(expected, got) -> bool:
    """Equal, for dicts and lists element-wise with the composed side allowed extra dict keys
    (a hook's default params); numbers compared as numbers, anything else as text."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(k in got and _matches(v, got[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(_matches, expected, got))
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and isinstance(got, (int, float)):
        return float(expected) == float(got)
    if isinstance(expected, str) and isinstance(got, str) and ".py:" in expected:
        prefix = "openenv:" if expected.startswith("openenv:") and got.startswith("openenv:") else ""
        expected, got = expected[len(prefix):], got[len(prefix):]  # rollout.agent=openenv:path/env.py:Class
        return got == expected or got.endswith("/" + expected)  # a file reference is made absolute
    return str(expected) == str(got) if expected is not None else got is None


def test_the_docs_have_commands():
    where = {c.where.split(":")[0] for c in ALL}
    assert len(ALL) > 40 and {"README.md", "merge.md", "rewards.md", "migrating.md"} <= where


@pytest.mark.parametrize("command", ALL, ids=[c.where for c in ALL])
def test_every_documented_command_runs_as_written(command, tmp_path, monkeypatch):
    """The user's own files a command names (my_rewards.py:score) are made under tmp_path, an
    absolute one (/shared/code/my_reward.py) at the same path below it, and the command is checked
    with that path: nothing is written outside the test's directory."""
    monkeypatch.chdir(tmp_path)
    args = list(command.args)
    for name in set(re.findall(r"([\w./-]+\.py):", " ".join(args))):
        made = tmp_path / name.lstrip("/")
        made.parent.mkdir(parents=True, exist_ok=True)
        made.touch()
        if name.startswith("/"):
            args = [a.replace(name, str(made)) for a in args]
    moved = Command(command.where, command.program, args)
    assert problems_of(moved) == [], f"{command.where}: {command.program} {' '.join(command.args)}"


def test_a_planted_mismatch_is_caught(tmp_path, monkeypatch):
    doc = tmp_path / "planted.md"
    doc.write_text("Run it:\n\n```bash\n.venv/bin/hybridflow reward.fn=math_answer \\\n"
                   "    stages.grpo.trainer.total_steps=9\n```\n\nor `hybridflow recipe.demo_prompts=4`.\n"
                   "```bash\nhybridflow-merge --method sma --run-dir runs/x --output OUT\n```\n")
    planted = commands_in(doc)
    assert [(c.where, c.program) for c in planted] == [("planted.md:4", "hybridflow"), ("planted.md:8", "hybridflow"),
                                                       ("planted.md:10", "hybridflow-merge")]
    assert problems_of(planted[0]) == []
    assert "does not compose" in problems_of(planted[1])[0]  # a key no stage reads
    assert "do not parse" in problems_of(planted[2])[0]  # no such flag
    # overrides that stop reaching a stage: the check sees it
    import hybridflow.run.pipeline_stages as stages

    monkeypatch.setattr(stages, "route", lambda config: {s.name: [] for s in config.pipeline.stages})
    assert sorted(problems_of(planted[0])) == [
        "reward.fn=math_answer: grpo has reward.fn='exact_match'", "reward.fn=math_answer: sft has reward.fn='exact_match'",
        "stages.grpo.trainer.total_steps=9: grpo has trainer.total_steps=150"]


def test_the_cluster_pages_command_composes_to_what_the_page_says(tmp_path, monkeypatch):
    """docs/cluster.md's two-node run: the dtypes and lengths its prose states, and a rollout TP
    equal to its pool's ranks (the one TP besides 1 that starts)."""
    page = (ROOT / "docs" / "cluster.md").read_text()
    [command] = [c for c in commands_in(ROOT / "docs" / "cluster.md") if "rollout.tensor_parallel_size=2" in c.args]
    monkeypatch.chdir(tmp_path)
    from hybridflow.run.pipeline_stages import compose_command

    (tmp_path / "my_reward.py").touch()
    config = compose_command([a.replace("/shared/code/", f"{tmp_path}/") for a in command.args])
    stated = re.search(r"compute in (\w+)\s+over (\w+) master weights, the rollout in (\w+), prompts of up to "
                       r"(\d+) tokens and answers of\s+up to (\d+) tokens", page)
    assert stated, "docs/cluster.md no longer states the run's dtypes and lengths"
    assert (config.model.dtype.value, config.model.master_dtype.value, config.rollout.dtype.value) == stated.groups()[:3]
    assert (config.data.max_prompt_tokens, config.rollout.max_response_tokens) == tuple(map(int, stated.groups()[3:]))
    gen = config.placement.pools[config.placement.roles["rollout"]]
    assert config.rollout.tensor_parallel_size == gen.nodes * gen.devices_per_node == 2
    assert config.placement.device.value == "cuda"
