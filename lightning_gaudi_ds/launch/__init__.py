"""Launching: start a script on N ranks with torchrun, DeepSpeed's launcher or mpirun, and own its processes.

- :mod:`.hostfile`: DeepSpeed's hostfile format, checked line by line.
- :mod:`.slurm`: a SLURM allocation as the hosts of a launch, instead of a hostfile.
- :mod:`.plan`: checked arguments -> argv and environment per launcher (no processes, no ports).
- :mod:`.supervise`: runs a plan, watches the ranks, stops the job, says how it ended.
- :mod:`.runner`: :class:`DistributedRunner`, the public face of the two above, and ``spawn``'s CLI.
- :mod:`.rank`: the shim each rank runs under (started by path).
- :mod:`.environments`: Lightning cluster environments for processes an external launcher started (imports
  Lightning, so it is not imported here).
"""

from lightning_gaudi_ds.launch.hostfile import Host, HostfileError, parse_hostfile, parse_hostfile_text
from lightning_gaudi_ds.launch.runner import DistributedRunner

__all__ = ["DistributedRunner", "Host", "HostfileError", "parse_hostfile", "parse_hostfile_text"]
