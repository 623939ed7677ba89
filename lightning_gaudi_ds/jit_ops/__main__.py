import sys

from lightning_gaudi_ds.jit_ops.build import main

sys.exit(main())
