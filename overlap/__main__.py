"""`python -m overlap COMMAND`: the console script `overlap` (overlap/tools/cli.py)."""

from overlap.tools.cli import main

raise SystemExit(main())
