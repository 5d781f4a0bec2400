from overlap.cli import main

raise SystemExit(main())
