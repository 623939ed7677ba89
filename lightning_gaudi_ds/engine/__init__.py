"""Building DeepSpeed engines: :mod:`.train` (optimizer sources, ZeRO-Offload's optimizer) and :mod:`.inference`
(``deepspeed.init_inference``: tensor-parallel predict/validate/test)."""
