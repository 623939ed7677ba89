"""A sharded ZeRO checkpoint to a Hugging Face model directory, or to one safetensors file.

The weights are read once, merged to fp32 (:func:`~lightning_gaudi_ds.checkpoint.convert.read_fp32_checkpoint`);
the model's class, config and tokenizer come from the checkpoint itself, where the strategy recorded them at save
(:func:`lightning_gaudi_ds.hf.model_info`, under :data:`HF_MODELS`). transformers then writes the directory: the
model is built on the meta device, given the merged tensors, its tied weights tied again, and saved with
``save_pretrained``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_gaudi_ds.checkpoint.convert import check_output, read_fp32_checkpoint
from lightning_gaudi_ds.checkpoint.io import PARTIAL, CheckpointError, PathLike
from lightning_gaudi_ds.errors import ConfigError

HF_MODELS = "hugging_face_models"  # key of the Lightning checkpoint: {prefix: {"class", "config", "tokenizer"}}
# The weight files of a save_pretrained directory: an earlier export's that this one does not write are removed, or
# transformers would load them (it prefers model.safetensors to an index of shards).
_WEIGHT_FILE = re.compile(r"(model|adapter_model)(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def check_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes, parsed as ``save_pretrained`` parses it (huggingface_hub's ``parse_size_to_int``:
    a number and one of the units KB, MB, GB, TB; or an int of bytes); a ``ConfigError`` naming it otherwise."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size_to_int(str(value))
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"max_shard_size (--max-shard-size) {value!r} is not a size: pass a number and a unit of"
                          ' KB, MB, GB or TB, e.g. "5GB" or "500MB" (or an int of bytes).')
    return size


def export_hf(
    checkpoint_dir: PathLike, output_dir: PathLike, *, tag: str | None = None, module: str | None = None,
    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None, merge_adapters: bool = False,
    overwrite: bool = False, weights_only: bool | None = None,
) -> Path:
    """Write the Hugging Face model of a ZeRO checkpoint (any stage, any world size) as a ``from_pretrained``
    directory: ``config.json``, safetensors shards (with their index when there are several), the tokenizer's files
    when the LightningModule had a ``tokenizer``. For a PEFT model: its adapters (``adapter_model.safetensors``,
    ``adapter_config.json``, for ``PeftModel.from_pretrained(base, output_dir)``), or with ``merge_adapters`` the
    base model with the adapters merged in (a plain ``from_pretrained`` directory; needs ``peft`` either way).

    Args:
        module: the model's attribute path in the LightningModule (``"model"`` for ``self.model``); needed only when
            the module holds more than one Hugging Face model.
        max_shard_size: the largest safetensors shard, as ``save_pretrained`` takes it.
        dtype: cast the weights (default: fp32, as merged).
        merge_adapters: a PEFT model: write the merged model instead of the adapters.
        overwrite: write into an existing ``output_dir`` (an earlier export: it holds a ``config.json``). Only the files
            this export writes are replaced, and an earlier export's weight files that it does not write
            (``model*.safetensors``, their index); nothing else there is touched.

    Returns the directory. Tied weights (``lm_head`` and the embeddings) are written once, as transformers does.
    """
    output_dir = Path(output_dir)
    check_shard_size(max_shard_size)
    check_output(Path(checkpoint_dir), output_dir, overwrite)
    if output_dir.is_dir() and any(output_dir.iterdir()) and not any(
        (output_dir / name).is_file() for name in ("config.json", "adapter_config.json")
    ):  # --overwrite replaces a model directory, never an arbitrary folder
        raise CheckpointError(f"output {str(output_dir)!r} is a folder that holds no Hugging Face model; --overwrite"
                              " replaces only an earlier export. Pass a new or empty directory.")
    if output_dir.exists() and not output_dir.is_dir():
        raise CheckpointError(f"output {str(output_dir)!r} is a file; --to hf writes a directory.")
    checkpoint = read_fp32_checkpoint(checkpoint_dir, tag, weights_only)
    prefix, entry = _choose_model(checkpoint, checkpoint_dir, module)
    state = {k.removeprefix(prefix + ".") if prefix else k: v for k, v in checkpoint["state_dict"].items()
             if not prefix or k.startswith(prefix + ".")}
    model = _build(entry, state)
    if merge_adapters and "peft" in entry:
        model = model.merge_and_unload()
    if dtype is not None:
        model.to(dtype)
    tmp = output_dir.with_name(output_dir.name + PARTIAL)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        for name, data in (entry.get("tokenizer") or {}).items():
            (tmp / Path(name).name).write_bytes(data)
        _move_into(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def _move_into(tmp: Path, output_dir: Path) -> None:
    """The files of ``tmp`` into ``output_dir``, each replacing the file of its name; an earlier export's weight files
    that ``tmp`` does not hold are removed. ``tmp`` itself is removed."""
    if not output_dir.exists():
        os.replace(tmp, output_dir)
        return
    written = {p.name for p in tmp.iterdir()}
    for stale in output_dir.iterdir():
        if stale.name not in written and stale.is_file() and _WEIGHT_FILE.fullmatch(stale.name):
            stale.unlink()
    for name in sorted(written):
        os.replace(tmp / name, output_dir / name)
    tmp.rmdir()


def export_safetensors(
    checkpoint_dir: PathLike, output_file: PathLike, *, tag: str | None = None, overwrite: bool = False,
    weights_only: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Write the LightningModule's fp32 ``state_dict`` (the keys of ``convert``'s ``"state_dict"``) as one
    safetensors file; weights that share memory (tied) are written as separate copies. Returns the state dict."""
    from safetensors.torch import save_file

    output_file = Path(output_file)
    check_output(Path(checkpoint_dir), output_file, overwrite, "model.safetensors")
    state = read_fp32_checkpoint(checkpoint_dir, tag, weights_only)["state_dict"]
    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        plain[key] = tensor.clone().contiguous() if storage in seen else tensor.contiguous()
        seen.add(storage)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_file.with_name(output_file.name + PARTIAL)
    try:
        save_file(plain, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, output_file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return plain


def _choose_model(checkpoint: dict[str, Any], path: PathLike, module: str | None) -> tuple[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = checkpoint.get(HF_MODELS) or {}
    if not models:
        raise CheckpointError(
            f"{str(path)!r} records no Hugging Face model: it was saved by a LightningModule without a transformers"
            " PreTrainedModel attribute, or by an older lightning-gaudi-ds that did not record it. Use"
            " `--to safetensors` (the module's state dict) or `convert` without --to (a Lightning .pt file)."
        )
    if module is not None:
        if module not in models:
            raise CheckpointError(f"--module {module!r}: the checkpoint's Hugging Face models are at"
                                  f" {sorted(models)}; pass one of these.")
        return module, models[module]
    if len(models) > 1:
        raise CheckpointError(f"{str(path)!r} holds {len(models)} Hugging Face models, at {sorted(models)}; pass"
                              " --module NAME (module=NAME) to say which to export.")
    return next(iter(models.items()))


def _build(entry: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    """The recorded model class on the meta device, given ``state``; transformers' tied weights tied again."""
    import transformers

    cls = getattr(transformers, str(entry["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and cls.config_class):
        raise CheckpointError(f"the checkpoint's model class {entry['class']!r} is not a model class of the installed"
                              f" transformers {transformers.__version__}.")
    config = cls.config_class.from_dict(entry["config"])
    with torch.device("meta"):
        model = cls(config)
        if entry.get("peft"):
            model = _with_adapters(model, entry["peft"])
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise CheckpointError(
            f"the checkpoint's weights do not fit {entry['class']}: missing {still_meta or missing},"
            f" unexpected {unexpected}."
        )
    return model.eval()


def _with_adapters(model: Any, adapters: dict[str, dict[str, Any]]) -> Any:
    """``model`` wrapped in a ``PeftModel`` with the recorded adapters (on the meta device, like ``model``)."""
    try:
        import peft
    except ImportError as err:
        raise CheckpointError(f"the checkpoint's model has PEFT adapters ({', '.join(adapters)}): exporting it needs"
                              " peft (`pip install peft`).") from err
    (first, config), *others = adapters.items()
    wrapped = peft.get_peft_model(model, peft.get_peft_config(config), adapter_name=first)
    for name, config in others:
        wrapped.add_adapter(name, peft.get_peft_config(config))
    return wrapped
