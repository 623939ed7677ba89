import sys

from lightning_gaudi_ds.cli import main

sys.exit(main())
