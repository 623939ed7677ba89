"""Building DeepSpeed engines: :mod:`.train` (optimizer sources, ZeRO-Offload's optimizer)."""
