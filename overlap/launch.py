"""`overlap.launch`: the path the README documents for `overlap.launch.init_from_env` and
`run_local_world`; the module lives at `overlap.tools.worlds.launch` and this name is the same
module object."""

import sys

from overlap.tools.worlds import launch as _module

sys.modules[__name__] = _module
