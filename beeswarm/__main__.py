from beeswarm.cli import main

raise SystemExit(main())
