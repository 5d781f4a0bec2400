from overlap.tools.cli import main

raise SystemExit(main())
