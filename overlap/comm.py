"""`overlap.comm`: the path the README documents for `overlap.comm.CollectiveError`; the module lives at
`overlap.transport.collectives` and this name is the same module object."""

import sys

from overlap.transport import collectives as _module

sys.modules[__name__] = _module
