"""The correlator: drained records to token, step and request rows.

Its modules run compiled by mypyc where the build made them and they are of this source, else as
Python (build_stamp.py says why).
"""

from sparseety_prof.correlate import build_stamp as _build_stamp

_where, _build_stamp.STATE = _build_stamp.compiled_dir(_build_stamp.package_dir())
if _where is not None:
    # the package's submodules are looked for in the compiled folder first (the import system
    # tries each __path__ entry in order); build_stamp, never compiled, is already imported
    __path__.insert(0, str(_where))
