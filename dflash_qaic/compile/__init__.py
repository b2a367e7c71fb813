"""The compiler step (profiles, compiler inputs, command lines, QPC cache).

The package is callable: `dflash_qaic.compile(artifacts_dir, **options)` is
`dflash_qaic.api.compile` (compile an artifacts directory's programs; see its docstring).
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from dflash_qaic.api import compile

        return compile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
