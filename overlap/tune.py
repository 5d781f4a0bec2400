"""`overlap.tune`: the path the README documents for `overlap.tune.tune`; the module lives at
`overlap.tools.tune` and this name is the same module object."""

import sys

from overlap.tools import tune as _module

sys.modules[__name__] = _module
