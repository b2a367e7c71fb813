import sys

from dflash_qaic.serve.cli import main

sys.exit(main())
