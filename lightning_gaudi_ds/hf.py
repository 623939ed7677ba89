"""Hugging Face ``transformers`` models under ZeRO-3: loading pretrained weights into partitions, what a checkpoint
records for the export, mixture-of-experts leaf modules.

``from_pretrained`` inside ``configure_model`` builds the model inside the strategy's ZeRO-3 partitioned
construction (``deepspeed.zero.Init``), where every parameter is an empty placeholder. transformers loads a
checkpoint into such a model only when its DeepSpeed integration says ZeRO-3 is on: then it gathers one module's
parameters at a time, copies rank 0's values in and re-partitions them, so no rank ever holds the whole model.
:func:`zero3_loading` tells it so with transformers' own ``HfDeepSpeedConfig`` (fed the strategy's resolved config)
for exactly as long as the partitioned construction lasts, and restores transformers' global state afterwards.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_gaudi_ds import _compat
from lightning_gaudi_ds._classes import module_classes
from lightning_gaudi_ds.checkpoint import export
from lightning_gaudi_ds.config import ConfigError
from lightning_gaudi_ds.errors import ModelLoadError


@contextlib.contextmanager
def zero3_loading(config: dict[str, Any] | None) -> Iterator[None]:
    """While inside, transformers sees ZeRO-3 with ``config`` (``is_deepspeed_zero3_enabled()`` is True).

    ``config``: the resolved DeepSpeed config of a ZeRO-3 run; None (any other stage) or transformers not installed:
    nothing changes. transformers keeps only a weak reference to the ``HfDeepSpeedConfig``: this context holds the
    object, and on exit puts back whatever transformers referred to before (usually nothing).
    """
    if config is None or importlib.util.find_spec("transformers") is None:
        yield
        return
    user_imported = "transformers" in sys.modules
    from transformers.integrations import deepspeed as hf_deepspeed

    previous = _compat.hf_deepspeed_config_ref()
    try:
        hf_config = hf_deepspeed.HfDeepSpeedConfig(config)
    except ImportError as err:  # transformers' DeepSpeed integration needs `accelerate`
        if user_imported:
            rank_zero_warn(
                f"ZeRO-3: transformers cannot be told that ZeRO-3 is on ({err}), so `from_pretrained` inside"
                " `configure_model` would load nothing into the partitioned parameters. Install it:"
                " `pip install accelerate`."
            )
        yield
        return
    try:
        yield
    finally:
        still_ours = _compat.hf_deepspeed_config_ref()
        if still_ours is not None and still_ours() is hf_config:
            if previous is not None and previous() is not None:
                hf_deepspeed.set_hf_deepspeed_config(previous())
            else:
                hf_deepspeed.unset_hf_deepspeed_config()
        del hf_config


@contextlib.contextmanager
def loading_errors_named() -> Iterator[None]:
    """Inside (``configure_model``, Fabric's ``init_module``): two errors of ``from_pretrained`` that name nothing
    name what failed, raised as the same type. A model id that is neither a folder nor in the Hugging Face cache
    while offline (an ``OSError``) gets the id and the fix; a cut-short safetensors file ("incomplete metadata",
    safetensors' ``SafetensorError``) gets the file."""
    try:
        yield
    except OSError as err:
        repo = _offline_miss(err)
        if repo is None:
            raise
        raise ModelLoadError(
            f"from_pretrained({repo!r}): no folder of that name, and it is not in the Hugging Face cache while the"
            " hub is offline (HF_HUB_OFFLINE=1 or local_files_only=True). Pass the path of the model's folder, or"
            f" download it once with the hub online (unset HF_HUB_OFFLINE; `hf download {repo}`)."
        ) from err
    except Exception as err:
        broken = _broken_safetensors(err) if type(err).__name__ == "SafetensorError" else []
        if not broken:
            raise
        raise type(err)(f"{', '.join(broken)}: {err}. The file is cut short or damaged (an interrupted download or"
                        " copy): download or copy it again.") from err


def _frame_values(err: BaseException) -> Iterator[tuple[str, Any]]:
    """The local variables of every frame ``err`` passed through, innermost first."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        yield from frame.f_locals.items()


def _offline_miss(err: OSError) -> str | None:
    """The model id of transformers' "couldn't connect ... couldn't find them in the cached files" while offline."""
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError:
        return None
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    return next((v for k, v in _frame_values(err) if k in ("path_or_repo_id", "pretrained_model_name_or_path")
                 and isinstance(v, str) and not Path(v).is_dir()), None)


def _broken_safetensors(err: BaseException) -> list[str]:
    """The safetensors files the failing load was reading that do not open."""
    from safetensors import safe_open

    files: list[str] = []
    for _, value in _frame_values(err):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (str, Path)) and str(item).endswith(".safetensors") and str(item) not in files:
                files.append(str(item))
    broken = []
    for file in files:
        try:
            with safe_open(file, "pt"):
                pass
        except Exception:  # noqa: BLE001  (any failure to open is what is reported)
            broken.append(file)
    return broken


@contextlib.contextmanager
def zero3_init_paused() -> Iterator[None]:
    """Inside ``configure_model`` under ZeRO-3: modules created here are built whole and initialized as usual;
    ``deepspeed.initialize`` partitions them later (after a broadcast from rank 0). For model surgery after
    ``from_pretrained`` whose initialization writes into the new parameters, such as PEFT's
    ``get_peft_model`` (LoRA's ``B`` is zeroed after construction; on a partitioned placeholder that does nothing).
    Outside ZeRO-3's partitioned construction it changes nothing."""
    with _compat.zero_init_paused():
        yield


# ----------------------------------------------------------------------------------- what a checkpoint records
HF_MODELS = export.HF_MODELS  # the Lightning checkpoint's key for what model_info returns


def with_model_info(checkpoint: dict[str, Any], module: Module | None) -> dict[str, Any]:
    """``checkpoint`` with :func:`model_info` of ``module`` under :data:`HF_MODELS` when it holds Hugging Face
    models: what ``lightning-gaudi-ds convert --to hf`` needs besides the weights."""
    models = model_info(module) if module is not None else {}
    return {**checkpoint, HF_MODELS: models} if models else checkpoint


def model_info(module: Module) -> dict[str, dict[str, Any]]:
    """The Hugging Face models inside ``module`` as plain data, for :func:`~lightning_gaudi_ds.checkpoint.export_hf`.

    ``{prefix: {"class": "LlamaForCausalLM", "config": {...}, "tokenizer": {file name: bytes}}}``, one entry per
    outermost ``PreTrainedModel`` or PEFT ``PeftModel`` (``prefix``: its name in the module's ``state_dict``, ``""``
    for the module itself); a ``PeftModel``'s entry describes its base model and adds ``"peft"``: its adapters'
    configs by name. The tokenizer is the module's attribute that is a transformers tokenizer, if any. Empty without
    transformers.
    """
    if "transformers" not in sys.modules:  # a module holding a Hugging Face model has imported it
        return {}
    import transformers

    peft_model = getattr(sys.modules.get("peft"), "PeftModel", ())
    found: dict[str, dict[str, Any]] = {}
    for name, sub in module.named_modules():
        if any(name == p or name.startswith(p + ".") or p == "" for p in found):
            continue
        if peft_model and isinstance(sub, peft_model):
            base = sub.get_base_model()
            found[name] = {"class": type(base).__name__, "config": json.loads(base.config.to_json_string()),
                           "peft": {k: json.loads(json.dumps(c.to_dict(), default=_json_default))
                                    for k, c in sub.peft_config.items()}}
        elif isinstance(sub, transformers.PreTrainedModel):
            found[name] = {"class": type(sub).__name__, "config": json.loads(sub.config.to_json_string())}
    tokenizers = [v for v in vars(module).values() if isinstance(v, transformers.PreTrainedTokenizerBase)]
    if found and tokenizers:
        with tempfile.TemporaryDirectory(prefix="lightning_gaudi_ds-tokenizer-") as folder:
            tokenizers[0].save_pretrained(folder)
            files = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
        for entry in found.values():
            entry["tokenizer"] = files
    return found


def _json_default(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)  # PEFT's target_modules is a set


# ------------------------------------------------------------------------------- ZeRO-3 leaf modules (MoE)
def leaf_module_classes(value: Sequence[type[Module] | str] | None) -> tuple[type[Module], ...]:
    """``HPUDeepSpeedStrategy(zero3_leaf_modules=...)`` as module classes (import paths imported)."""
    return module_classes(value, "zero3_leaf_modules", "Give module classes or their import paths, e.g."
                          " ['transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock'].")


def mark_leaf_modules(model: Module, classes: tuple[type[Module], ...]) -> None:
    """Flag every instance of ``classes`` in ``model`` as a ZeRO-3 leaf (before the engine installs its hooks)."""
    from deepspeed.utils import set_z3_leaf_modules

    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in model.modules())]
    if missing:
        has = sorted({type(m).__name__ for m in model.modules()})
        close = sorted({n for name in missing for n in difflib.get_close_matches(name, has, n=3, cutoff=0.5)})
        listed = f"close names it has: {', '.join(close)}" if close else f"its module classes: {', '.join(has[:12])}"
        raise ConfigError(
            f"HPUDeepSpeedStrategy(zero3_leaf_modules=...): the model has no {', '.join(missing)} module ({listed})."
            " Name classes the model built in configure_model uses, e.g. its mixture-of-experts block."
        )
    set_z3_leaf_modules(model, list(classes))
