"""Export to ONNX programs and an artifacts directory.

The package is callable: `dflash_qaic.export(target, draft, out, **options)` is
`dflash_qaic.api.export` (a Python `dflash-export`; see its docstring).
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from dflash_qaic.api import export

        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
