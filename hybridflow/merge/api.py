"""The Python entry points: merge checkpoints on disk into a Hugging Face model directory,
or merge state dicts in memory (for hooks inside a training process).

`merge_checkpoints` validates everything it can before writing, writes into a temporary
directory next to the output and renames it into place only when every tensor, file and
record is written: a failure or an interrupt leaves no output and no temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from contextlib import ExitStack, closing
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from hybridflow.merge import dcp, lora  # noqa: F401  (importing them registers the "dcp" and "lora" formats)
from hybridflow.merge.checkpoints import Checkpoint, StateDictCheckpoint, open_checkpoint
from hybridflow.merge.engine import StreamingMerger
from hybridflow.merge.errors import MergeError
from hybridflow.merge.methods import MERGE_METHODS, METHODS_WITHOUT_BASE, MergeParams, check_params, linear_form
from hybridflow.merge.provenance import InputHasher, build_provenance, safetensors_metadata
from hybridflow.merge.safetensors_io import OutputTensor, ShardedWriter, all_finite
from hybridflow.merge.validate import build_plan, check_inputs

PathLike = Union[str, "os.PathLike[str]"]
DEFAULT_MAX_SHARD_BYTES = 2 * 1000**3  # 2 GB, as Hugging Face's save_pretrained default was
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROVENANCE_FILE = "merge_provenance.json"


def make_params(**params) -> MergeParams:
    """MergeParams from keyword arguments; `lambda` is accepted for `lam`."""
    if "lambda" in params:
        params["lam"] = params.pop("lambda")
    known = {f.name for f in fields(MergeParams)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise MergeError(f"unknown merge parameters {unknown}; known: {sorted(known)}")
    return MergeParams(**{k: v for k, v in params.items() if v is not None})


def output_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in OUTPUT_DTYPES:
        raise MergeError(f"dtype {dtype!r} is not one of {sorted(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[dtype]


def merge_checkpoints(inputs: Sequence[PathLike], output: PathLike, method: str, *, base: Optional[PathLike] = None,
                      dtype: Union[str, torch.dtype, None] = None, overwrite: bool = False,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, hash_inputs: bool = True,
                      **params) -> Path:
    """Merge `inputs` (oldest first, newest last) with `method` into the directory `output`.

    inputs: Hugging Face safetensors directories, .safetensors files, LoRA adapter
        directories (folded into `base`, or into the local base their config names),
        FSDP2 / DCP training states (`step_<N>/actor`) and run step directories (`step_<N>`,
        standing for their hf/, else their actor/).
    base: the base model of task-vector methods and of LoRA inputs; for a DCP input without
        an hf/ beside it, the model whose config and tokenizer files are copied.
    dtype: "float32" | "bfloat16" | "float16" for floating tensors; None keeps the inputs'.
    params: the fields of MergeParams (alpha, weights, normalize, lam or lambda, density, t, seed).
    Returns the output path. Non-weight files (config, tokenizer, ...) come from the newest input.
    """
    output = Path(output).expanduser()
    input_paths = [Path(p).expanduser() for p in inputs]
    _check_output(output, input_paths + ([Path(base).expanduser()] if base else []), overwrite)
    merge_params = make_params(**params)
    MERGE_METHODS.get(method)  # unknown names fail here, listing the known ones
    torch_dtype = output_dtype(dtype)
    with ExitStack() as stack:
        base_ckpt = stack.enter_context(closing(open_checkpoint(base))) if base else None
        ckpts = [stack.enter_context(closing(open_checkpoint(p, base=base_ckpt))) for p in input_paths]
        _check_base_use(method, base_ckpt, ckpts)
        check_params(method, merge_params, len(ckpts), base_ckpt is not None)
        merger = _prepare(ckpts, base_ckpt, method, merge_params, torch_dtype, reuse_output=True)
        hasher = _start_hasher(ckpts + ([base_ckpt] if base_ckpt else []), stack) if hash_inputs else None
        dtype_name = str(torch_dtype).removeprefix("torch.") if torch_dtype else None
        record = partial(build_provenance, method, merge_params, ckpts, base_ckpt, dtype_name,
                         _effective_weights(method, len(ckpts), merge_params))
        return _write_atomically(
            output, overwrite, partial(_write, merger=merger, newest=ckpts[-1], record=record, hasher=hasher,
                                       max_shard_bytes=max_shard_bytes, dtype=torch_dtype))


def merge_state_dicts(state_dicts: Sequence[dict[str, torch.Tensor]], method: str, *,
                      base: Optional[dict[str, torch.Tensor]] = None, dtype: Union[str, torch.dtype, None] = None,
                      **params) -> dict[str, torch.Tensor]:
    """The same merge on in-memory state dicts (oldest first); the same validation rules.

    E.g. an EMA reference model: merge_state_dicts([ref, actor], "ema", alpha=0.05).
    Inputs are not modified; tied keys share one output tensor.
    """
    merge_params = make_params(**params)
    ckpts = [StateDictCheckpoint(sd, f"state_dict[{i}]") for i, sd in enumerate(state_dicts)]
    base_ckpt = StateDictCheckpoint(base, "base") if base is not None else None
    _check_base_use(method, base_ckpt, ckpts)
    check_params(method, merge_params, len(ckpts), base_ckpt is not None)
    merger = _prepare(ckpts, base_ckpt, method, merge_params, output_dtype(dtype))
    merged = {}
    for key, tensor in merger:
        if key in merger.plan.tied:
            merged[key] = merged[merger.plan.tied[key]]
            continue
        # copied keys are the newest input's own tensors: copy them so the result shares no memory with it
        merged[key] = tensor.to(merger.out_dtypes[key], copy=key in merger.plan.copied)
        if not all_finite(merged[key]):
            raise MergeError(f"merged tensor {key!r} has values beyond the range of {merged[key].dtype}; "
                             "use a wider dtype")
    return merged


def _start_hasher(checkpoints: list[Checkpoint], stack: ExitStack) -> InputHasher:
    """Attached after planning, so that only the merge's own reads feed it."""
    hasher = InputHasher([f for c in checkpoints for f in c.weight_files()])
    stack.callback(hasher.close)
    for checkpoint in checkpoints:
        checkpoint.attach_hasher(hasher)
    return hasher


def _prepare(ckpts: list[Checkpoint], base: Optional[Checkpoint], method: str, params: MergeParams,
             dtype: Optional[torch.dtype], reuse_output: bool = False) -> StreamingMerger:
    check_inputs(ckpts, base)
    plan = build_plan(ckpts, None if method in METHODS_WITHOUT_BASE else base)
    newest = ckpts[-1]
    out_dtypes = {k: newest.dtype(k) if (k in plan.copied or dtype is None) else dtype for k in plan.keys}
    return StreamingMerger(ckpts, base, method, params, plan, out_dtypes, reuse_output)


def _write(tmp: Path, *, merger: StreamingMerger, newest: Checkpoint, record, hasher: Optional[InputHasher],
           max_shard_bytes: int, dtype: Optional[torch.dtype]) -> None:
    planned = [OutputTensor(k, merger.out_dtypes[k], newest.shape(k)) for k in merger.plan.keys]
    files = hasher.files if hasher else []
    placeholder = record({f: "0" * 64 for f in files})  # the real digests have the same length
    writer = ShardedWriter(tmp, planned, max_shard_bytes, safetensors_metadata(placeholder))
    try:
        for key, tensor in merger:
            writer.write(key, tensor)
            del tensor
        provenance = record(hasher.result() if hasher else {})
        writer.finish(safetensors_metadata(provenance))
    finally:
        writer.close()
    for source in newest.files_to_copy():
        _copy_extra(source, tmp / source.name, dtype)
    (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


def _copy_extra(source: Path, target: Path, dtype: Optional[torch.dtype]) -> None:
    """Copy a non-weight file; config.json gets the output dtype when one was asked for."""
    if source.name == "config.json" and dtype is not None:
        try:
            config = json.loads(source.read_text())
        except (OSError, json.JSONDecodeError):
            config = None
        if isinstance(config, dict):
            present = [f for f in ("torch_dtype", "dtype") if f in config] or ["torch_dtype"]
            for field in present:
                config[field] = str(dtype).removeprefix("torch.")
            target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            return
    shutil.copy2(source, target)


def _write_atomically(output: Path, overwrite: bool, write) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        write(tmp)
        if output.exists() or output.is_symlink():
            if not overwrite:
                raise MergeError(f"{output} appeared while merging; pass overwrite=True (--overwrite) to replace it")
            old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(output, old)
            os.rename(tmp, output)
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        else:
            os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _check_output(output: Path, inputs: list[Path], overwrite: bool) -> None:
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise MergeError(f"output {output} already exists; choose another path or pass overwrite=True (--overwrite)")
    resolved = output.resolve()
    for path in inputs:
        p = path.resolve()
        if p == resolved or resolved in p.parents:
            raise MergeError(f"output {output} is or contains the input {path}; write the merge elsewhere")


def _check_base_use(method: str, base: Optional[Checkpoint], ckpts: list[Checkpoint]) -> None:
    if base is not None and method in METHODS_WITHOUT_BASE and not any(c.uses_base for c in ckpts):
        raise MergeError(f"method {method!r} does not use a base model and no input needs one (a LoRA adapter to "
                         "fold into it, or a DCP checkpoint taking its config from it); drop --base")


def _effective_weights(method: str, n: int, params: MergeParams) -> Optional[tuple[float, ...]]:
    form = linear_form(method, n, params) if method in MERGE_METHODS else None
    return form.weights if form is not None else None

