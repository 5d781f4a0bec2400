"""Applications built on the engine, in layers:

    worlds/     where ranks run: the launcher, an emulated network link, picking the world
    workloads/  what they train: W1, the byte-level GPT and its data, the toy models
    demo/ plan/ tune/ bench/   the commands; each uses worlds and workloads, never another's
                internals
    cli.py      the `overlap` console script; flags.py builds a command's flags from its config

They use `overlap`'s public API and the engine's documented internals; the engine never imports
them. Modules that moved keep their old import paths for one release (`moved.MOVED`).
"""

from overlap.tools import moved

moved.install()
