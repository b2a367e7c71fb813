import sys

from dflash_qaic.extras import export_main

sys.exit(export_main())
