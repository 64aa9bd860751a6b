"""How long the `hybridflow` command takes to refuse bad input (docs/input_checks.md; docs/claims.md).

A refusal happens before the run directory, Ray, the models or vLLM start, so its time is the
interpreter's imports, Hydra's composition and the checks. Each case runs the command as a user does,
a fresh process each time, `--repeats` times, and must exit with status 2 without starting Ray; the
report holds each case's seconds (all and the median), its last line of error, and the CPU it ran
on. The tests assert what a refusal says and that Ray never started; the seconds are this script's
(timed tests flake on shared 2-core machines).

    .venv/bin/python bench/refusal_seconds.py --out bench/results/refusal_seconds.json
    .venv/bin/python bench/refusal_seconds.py --dry-run --out /tmp/refusal.json   # one case, once
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HYBRIDFLOW = Path(sys.executable).parent / "hybridflow"


def _rows(count: int, long_rows: tuple[int, ...] = ()) -> list[dict]:
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(count)]
    for i in long_rows:
        rows[i]["prompt"] = "1+" * 30 + "1="
    return rows


def cases(work: Path) -> dict[str, list[str]]:
    """Case name -> the command's arguments; the files they read are written under `work`."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    gaps = _rows(40)
    gaps[2]["ground_truth"] = None
    (data / "gaps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gaps))
    (data / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(40)))
    (data / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(1010, (1003, 1007))))
    small = ["trainer.prompts_per_step=4", "trainer.val_prompts=4", "data.max_prompt_tokens=32"]
    return {
        "a null ground truth (data file)": ["recipe=grpo", "data=files", f"data.train_path={data / 'gaps.jsonl'}",
                                            f"data.val_path={data / 'good.jsonl'}", *small],
        "a long prompt past the first 1,000 rows": ["recipe=grpo", "data=files", f"data.train_path={data / 'long.jsonl'}",
                                                    f"data.val_path={data / 'good.jsonl'}", *small],
        "a config value out of its choices": ["recipe=grpo", "data.prompt_truncation=right"],
    }


def refuse(argv: list[str], output_root: Path) -> dict:
    """One fresh `hybridflow` process: its exit status, seconds, and whether Ray wrote a session."""
    ray_tmp = output_root / "ray_tmp"
    start = time.perf_counter()
    done = subprocess.run([str(HYBRIDFLOW), *argv, f"logger.output_root={output_root / 'runs'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    seconds = time.perf_counter() - start
    return {"returncode": done.returncode, "seconds": seconds, "ray_started": ray_tmp.exists(),
            "error": (done.stderr.strip().splitlines() or [""])[-1][:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "refusal_seconds.json")
    parser.add_argument("--dry-run", action="store_true", help="the first case, once")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from hybridflow.precision import cpu_description

    report = {"command": " ".join(sys.argv), "cpu": cpu_description(), "cores": os.cpu_count(), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        chosen = cases(work)
        if args.dry_run:
            chosen, args.repeats = dict(list(chosen.items())[:1]), 1
        for name, argv in chosen.items():
            runs = [refuse(argv, work / f"{len(report['cases'])}_{i}") for i in range(args.repeats)]
            bad = [r for r in runs if r["returncode"] != 2 or r["ray_started"]]
            if bad:
                raise SystemExit(f"case {name!r} was not refused before Ray started: {bad[0]}")
            seconds = [r["seconds"] for r in runs]
            report["cases"][name] = {"median_s": statistics.median(seconds), "seconds": seconds,
                                     "error": runs[0]["error"]}
            print(f"{name}: median {statistics.median(seconds):.1f} s of {len(seconds)} ({runs[0]['error'][:120]})")
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
