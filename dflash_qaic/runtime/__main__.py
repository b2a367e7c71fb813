import sys

from dflash_qaic.runtime.cli import main

sys.exit(main())
