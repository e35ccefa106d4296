"""Command line gradient checks for CI: ``python -m vjpkit check MODULE:NAME``.

For example:

```python
python -m vjpkit check mypkg.ops:Linear --inputs "f64[20,20] f64[30,20]" --atol 1e-4
python -m vjpkit check mypkg.ops:Exp --inputs "f64[5]" --gradgrad
```

Exit status: 0 when every check passes, 1 when a check fails (or the
function raises), 2 on bad arguments. ``python -m vjpkit check --help``
lists the options.
"""

import sys

from ._checking.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
