"""Not helixtok itself: the root of a clone of its repository.  A program run in the folder that holds
the clone imports this folder as `helixtok` (the clone is named as the package), which would leave
`helixtok.build` undefined; so the import is handed to the package inside, as if it were installed."""

import os as _os

__path__ = [_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "helixtok")]
_inner = _os.path.join(__path__[0], "__init__.py")
with open(_inner) as _fh:
    exec(compile(_fh.read(), _inner, "exec"))
