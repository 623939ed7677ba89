"""The core under both strategies: :class:`~lightning_gaudi_ds.core.base.DeepSpeedCore`, the mixin the Trainer's
and Fabric's ``HPUDeepSpeedStrategy`` share, and :class:`~lightning_gaudi_ds.core.options.Options`, the package's own
arguments. Import from the modules themselves: this package imports nothing, so that reading the options costs
nothing."""
