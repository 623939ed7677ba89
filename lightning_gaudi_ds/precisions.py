"""Names shared by light and heavy modules alike (the ``plan`` CLI, the config keys, the device table): the
precisions the package knows, the ``"auto"`` value and the ZeRO section's name, and the device-tuned ZeRO keys.
Imports nothing, so the planner stays light."""

from __future__ import annotations

__all__ = ["AUTO", "HALF_PRECISIONS", "PRECISIONS", "PRECISION_DTYPES", "ZERO", "ZERO_DEFAULT_KEYS"]

#: The value a DeepSpeed config (and ``stage``) leaves to be filled (Hugging Face's convention).
AUTO = "auto"
#: The DeepSpeed config's ZeRO section.
ZERO = "zero_optimization"

#: Lightning precisions the strategy runs (the device table narrows them per device), and their parameter dtypes.
PRECISION_DTYPES = {
    "32-true": "float32",
    "bf16-mixed": "bfloat16", "bf16-true": "bfloat16",
    "16-mixed": "float16", "16-true": "float16",
}
PRECISIONS = tuple(PRECISION_DTYPES)
HALF_PRECISIONS = tuple(p for p in PRECISIONS if PRECISION_DTYPES[p] != "float32")

#: ``zero_optimization`` keys whose best value depends on the device (the device table's ``zero_defaults``).
ZERO_DEFAULT_KEYS = ("overlap_comm", "reduce_scatter", "contiguous_gradients", "use_multi_rank_bucket_allreduce")
