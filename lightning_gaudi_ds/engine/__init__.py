"""Building DeepSpeed engines: :mod:`.train` (optimizer sources, ZeRO-Offload's optimizer), :mod:`.inference`
(``deepspeed.init_inference``: tensor-parallel predict/validate/test) and :mod:`.device` (what the device needs around
the engine: Gaudi execution mode, compile, graph breaks, the move to the card)."""
