"""`hybridflow-merge`: merge checkpoints from the command line.

    hybridflow-merge --method sma --output OUT CKPT1 CKPT2 CKPT3
    hybridflow-merge --method ema --alpha 0.2 --output OUT --last 5 RUN_DIR
    hybridflow-merge --method ties --base BASE --density 0.3 --lambda 1.0 --output OUT FT1 FT2

Inputs are given oldest first. An error prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Optional, Sequence

from hybridflow.merge.api import DEFAULT_MAX_SHARD_BYTES, OUTPUT_DTYPES, merge_checkpoints
from hybridflow.merge.checkpoints import last_checkpoints
from hybridflow.merge.methods import MERGE_METHODS

BUILTIN_METHODS = ("sma", "ema", "wma", "linear", "task_arithmetic", "ties", "dare_linear", "dare_ties", "slerp")
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 bytes."""
    match = SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GB, 500MB or 512MiB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3}[unit.rstrip("I")]
    return int(number * base**power)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of the usage block, still status 2
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridflow-merge", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("inputs", nargs="*", metavar="INPUT",
                        help="checkpoints, oldest first: HF model dirs, .safetensors files, LoRA adapter dirs, "
                             "FSDP2/DCP dirs (step_N/actor), run step dirs (step_N: its hf/, else its actor/)")
    parser.add_argument("--method", required=True, metavar="NAME",
                        help=f"one of {', '.join(BUILTIN_METHODS)}, or package.module:function")
    parser.add_argument("--output", required=True, metavar="OUT", help="directory to create")
    parser.add_argument("--last", nargs=2, metavar=("N", "RUN_DIR"),
                        help="merge the last N complete checkpoints of a run instead of listing INPUTs")
    parser.add_argument("--base", help="base model: for task_arithmetic/ties/dare_*, to fold LoRA inputs, and as "
                                       "the config/tokenizer source of DCP inputs with no hf/ beside them")
    parser.add_argument("--alpha", type=float, help="EMA: weight of the newest checkpoint, in (0, 1]")
    parser.add_argument("--weights", type=float, nargs="+", metavar="W", help="one weight per input")
    parser.add_argument("--no-normalize", dest="normalize", action="store_false",
                        help="linear: use --weights as given instead of dividing by their sum")
    parser.add_argument("--density", type=float, help="TIES/DARE: fraction of task-vector entries kept")
    parser.add_argument("--lambda", dest="lam", type=float, help="scale of the merged task vector (default 1)")
    parser.add_argument("--t", type=float, help="SLERP: 0 gives the first input, 1 the second")
    parser.add_argument("--seed", type=int, help="DARE: random seed (default 0)")
    parser.add_argument("--dtype", choices=sorted(OUTPUT_DTYPES), help="output dtype (default: the inputs')")
    parser.add_argument("--shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest output shard, e.g. 2GB (default), 500MB")
    parser.add_argument("--no-hash", dest="hash_inputs", action="store_false",
                        help="skip the sha256 of the inputs in the provenance record")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    return parser


def resolve_inputs(args: argparse.Namespace) -> list[str]:
    if args.last and args.inputs:
        raise ValueError("give either INPUT paths or --last N RUN_DIR, not both")
    if args.last:
        count, run_dir = args.last
        if not count.isdigit():
            raise ValueError(f"--last {count} {run_dir}: N must be a whole number, e.g. --last 5 runs/sft")
        return [str(p) for p in last_checkpoints(run_dir, int(count))]
    if not args.inputs:
        raise ValueError("no inputs: list checkpoint paths or use --last N RUN_DIR")
    return args.inputs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 through argparse
    params = {k: getattr(args, k) for k in ("alpha", "weights", "density", "lam", "t", "seed")}
    try:
        MERGE_METHODS.get(args.method)  # an unknown name fails before --last is resolved, listing the known ones
        output = merge_checkpoints(resolve_inputs(args), args.output, args.method, base=args.base,
                                   dtype=args.dtype, overwrite=args.overwrite, max_shard_bytes=args.shard_size,
                                   hash_inputs=args.hash_inputs, normalize=args.normalize, **params)
    except (ValueError, KeyError, OSError, ImportError, AttributeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"hybridflow-merge: error: {' | '.join(str(message).splitlines())}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
