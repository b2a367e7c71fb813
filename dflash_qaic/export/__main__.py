import sys

from dflash_qaic.export.cli import main

sys.exit(main())
