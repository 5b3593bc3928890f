from fluxbooth.cli import main

raise SystemExit(main())
